//! One table of invariants over every layer type and option (the PEFT test-suite idea): B = 0 is the
//! identity; the forward equals the formula; merged == unmerged; merge → unmerge restores the base;
//! save → load is bit-identical; an optimizer step changes only adapter tensors; the parameter count
//! equals the formula; dropout only in training; disable gives the base output.

use crate::common;

use common::{dense, max_abs_diff};
use lora_core::base::BaseWeight;
use lora_core::config::{InitLoraWeights, LoraConfig};
use lora_core::conv::{Conv2dParams, LoraConv2d};
use lora_core::embedding::LoraEmbedding;
use lora_core::formats::peft;
use lora_core::inject::{
    Adaptable, SiteMut, inject, merge_adapters, set_adapters_enabled, unmerge_adapters,
};
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use lora_core::quant::{QuantKind, QuantWeight};
use lora_core::{Error, Result};
use tch::nn::OptimizerConfig;
use tch::{Device, Kind, Tensor, nn};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    Linear,
    LinearBias,
    LinearBf16,
    LinearQuant(QuantKind),
    Conv,
    Embedding,
    EmbeddingQ8,
}

#[derive(Clone, Copy, Debug)]
struct Opt {
    rank: i64,
    alpha: f64,
    rslora: bool,
    dora: bool,
    dropout: f64,
    init: InitLoraWeights,
}

const OUT: i64 = 48;
const IN: i64 = 64;

enum Layer {
    Lin(LoraLinear),
    Conv(LoraConv2d),
    Emb(LoraEmbedding),
}

struct One {
    name: &'static str,
    site: Site,
    layer: Layer,
}

impl Adaptable for One {
    fn visit_sites(&mut self, f: &mut dyn FnMut(&str, SiteMut<'_>) -> Result<()>) -> Result<()> {
        match &mut self.layer {
            Layer::Lin(l) => f(self.name, SiteMut::Linear(l)),
            Layer::Conv(l) => f(self.name, SiteMut::Conv2d(l)),
            Layer::Emb(l) => f(self.name, SiteMut::Embedding(l)),
        }
    }
}

impl One {
    fn new(site: Site) -> Self {
        let (name, layer) = match site {
            Site::Linear => (
                "model.layers.0.self_attn.q_proj",
                Layer::Lin(LoraLinear::new(BaseWeight::Dense(dense(&[OUT, IN], 1)), None).unwrap()),
            ),
            Site::LinearBias => (
                "model.layers.0.mlp.up_proj",
                Layer::Lin(
                    LoraLinear::new(
                        BaseWeight::Dense(dense(&[OUT, IN], 1)),
                        Some(dense(&[OUT], 2)),
                    )
                    .unwrap(),
                ),
            ),
            Site::LinearBf16 => (
                "model.layers.0.self_attn.v_proj",
                Layer::Lin(
                    LoraLinear::new(
                        BaseWeight::Dense(dense(&[OUT, IN], 1).to_kind(Kind::BFloat16)),
                        Some(dense(&[OUT], 2).to_kind(Kind::BFloat16)),
                    )
                    .unwrap(),
                ),
            ),
            Site::LinearQuant(k) => (
                "model.layers.1.self_attn.k_proj",
                Layer::Lin(
                    LoraLinear::new(
                        BaseWeight::Quant(QuantWeight::quantize(&dense(&[OUT, IN], 1), k).unwrap()),
                        None,
                    )
                    .unwrap(),
                ),
            ),
            Site::Conv => (
                "down_blocks.0.resnets.0.conv1",
                Layer::Conv(
                    LoraConv2d::new(
                        BaseWeight::Dense(dense(&[6, 4, 3, 3], 1)),
                        Some(dense(&[6], 2)),
                        Conv2dParams {
                            stride: [2, 1],
                            padding: [1, 1],
                            ..Default::default()
                        },
                    )
                    .unwrap(),
                ),
            ),
            Site::Embedding => (
                "model.embed_tokens",
                Layer::Emb(LoraEmbedding::new(BaseWeight::Dense(dense(&[OUT, IN], 1))).unwrap()),
            ),
            Site::EmbeddingQ8 => (
                "model.embed_tokens",
                Layer::Emb(
                    LoraEmbedding::new(BaseWeight::Quant(
                        QuantWeight::quantize(&dense(&[OUT, IN], 1), QuantKind::Q8_0).unwrap(),
                    ))
                    .unwrap(),
                ),
            ),
        };
        One { name, site, layer }
    }

    fn input(&self) -> Tensor {
        match self.site {
            Site::Conv => dense(&[2, 4, 7, 5], 11),
            Site::Embedding | Site::EmbeddingQ8 => {
                Tensor::from_slice(&[0i64, 3, 47, 3, 9, 21]).reshape([2, 3])
            }
            Site::LinearBf16 => dense(&[2, 3, IN], 11).to_kind(Kind::BFloat16),
            _ => dense(&[2, 3, IN], 11),
        }
    }

    fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        match &self.layer {
            Layer::Lin(l) => l.forward_t(x, train).unwrap(),
            Layer::Conv(l) => l.forward_t(x, train).unwrap(),
            Layer::Emb(l) => l.forward(x).unwrap(),
        }
    }

    fn layer(&self) -> &dyn LoraLayer {
        match &self.layer {
            Layer::Lin(l) => l,
            Layer::Conv(l) => l,
            Layer::Emb(l) => l,
        }
    }

    fn is_quant(&self) -> bool {
        self.layer().base().is_quantized()
    }

    /// Expected adapter parameter count.
    fn param_formula(&self, r: i64, dora: bool) -> i64 {
        let s = self.layer().base().shape();
        match self.site {
            Site::Conv => r * s[1] * s[2] * s[3] + s[0] * r + if dora { s[0] } else { 0 },
            Site::Embedding | Site::EmbeddingQ8 => r * (s[0] + s[1]),
            _ => r * (s[0] + s[1]) + if dora { s[0] } else { 0 },
        }
    }

    /// The formula, computed from the layer's own tensors (non-DoRA).
    fn formula(&self, x: &Tensor, name: &str) -> Tensor {
        let l = self.layer();
        let ad = l.adapter(name).unwrap();
        let s = ad.scaling();
        let w = l.base().weight(Kind::Float).unwrap();
        match &self.layer {
            Layer::Lin(lin) => {
                let xf = x.to_kind(Kind::Float);
                let mut y =
                    xf.matmul(&w.tr()) + xf.matmul(&ad.lora_a().tr()).matmul(&ad.lora_b().tr()) * s;
                if let Some(b) = lin.bias() {
                    y += b.to_kind(Kind::Float);
                }
                y
            }
            Layer::Conv(c) => {
                let p = c.params();
                let y = x.conv2d(&w, c.bias(), p.stride, p.padding, p.dilation, 1);
                y + x
                    .conv2d::<Tensor>(ad.lora_a(), None, p.stride, p.padding, p.dilation, 1)
                    .conv2d::<Tensor>(ad.lora_b(), None, [1, 1], [0, 0], [1, 1], 1)
                    * s
            }
            Layer::Emb(_) => {
                Tensor::embedding(&w, x, -1, false, false)
                    + Tensor::embedding(&ad.lora_a().tr(), x, -1, false, false)
                        .matmul(&ad.lora_b().tr())
                        * s
            }
        }
    }

    /// DoRA formula for Linear (peft/tuners/lora/dora.py), eval mode.
    fn dora_formula(&self, x: &Tensor, name: &str) -> Tensor {
        let l = self.layer();
        let ad = l.adapter(name).unwrap();
        let s = ad.scaling();
        let w = l.base().weight(Kind::Float).unwrap();
        if let Layer::Conv(c) = &self.layer {
            // peft/tuners/lora/dora.py::_DoraConvNdLayer
            let p = c.params();
            let r = ad.rank();
            let dw = ad
                .lora_b()
                .reshape([-1, r])
                .matmul(&ad.lora_a().reshape([r, -1]))
                .reshape(w.size());
            let norm = (&w + dw * s).norm_scalaropt_dim(2, [1, 2, 3], false);
            let g = (ad.magnitude().unwrap() / norm).reshape([1, -1, 1, 1]);
            let base = x.conv2d::<Tensor>(&w, None, p.stride, p.padding, p.dilation, 1);
            let lora = x
                .conv2d::<Tensor>(ad.lora_a(), None, p.stride, p.padding, p.dilation, 1)
                .conv2d::<Tensor>(ad.lora_b(), None, [1, 1], [0, 0], [1, 1], 1);
            return &base
                + (&g - 1.0) * &base
                + &g * lora * s
                + c.bias().unwrap().reshape([1, -1, 1, 1]);
        }
        let Layer::Lin(lin) = &self.layer else {
            panic!("linear or conv only")
        };
        let xf = x.to_kind(Kind::Float);
        let norm = (&w + ad.lora_b().matmul(ad.lora_a()) * s).norm_scalaropt_dim(2, [1], false);
        let g = ad.magnitude().unwrap() / norm;
        let base = xf.matmul(&w.tr());
        let lora = xf.matmul(&ad.lora_a().tr()).matmul(&ad.lora_b().tr());
        let mut y = &base + (&g - 1.0) * &base + &g * lora * s;
        if let Some(b) = lin.bias() {
            y += b.to_kind(Kind::Float);
        }
        y
    }

    fn base_snapshot(&self) -> Tensor {
        self.layer().base().weight(Kind::Float).unwrap().copy()
    }
}

fn randomize(model: &mut dyn Adaptable, name: &str, seed: i64) {
    let _g = tch::no_grad_guard();
    let mut k = seed;
    model
        .visit_sites(&mut |_, site| {
            if let Some(ad) = site.layer_ref().adapter(name) {
                for mut t in ad.parameters() {
                    k += 1;
                    let noise = dense(&t.size(), k) * 0.3;
                    if t.dim() == 1 {
                        // DoRA magnitude: keep it positive and near the current norms
                        let v = &t * (noise.abs() + 1.0);
                        t.copy_(&v);
                    } else {
                        t.copy_(&noise);
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

fn cfg_for(site: &One, o: &Opt) -> LoraConfig {
    let mut cfg = LoraConfig::new(o.rank, o.alpha, &[site.name.rsplit('.').next().unwrap()]);
    cfg.use_rslora = o.rslora;
    cfg.use_dora = o.dora;
    cfg.lora_dropout = o.dropout;
    cfg.init_lora_weights = o.init;
    cfg
}

fn sites() -> Vec<Site> {
    vec![
        Site::Linear,
        Site::LinearBias,
        Site::LinearBf16,
        Site::LinearQuant(QuantKind::Q8_0),
        Site::LinearQuant(QuantKind::Q4_0),
        Site::LinearQuant(QuantKind::Q4_1),
        Site::LinearQuant(QuantKind::Q5_1),
        Site::LinearQuant(QuantKind::Fp8E4m3),
        Site::LinearQuant(QuantKind::Nf4 {
            double_quant: false,
        }),
        Site::LinearQuant(QuantKind::Nf4 { double_quant: true }),
        Site::Conv,
        Site::Embedding,
        Site::EmbeddingQ8,
    ]
}

fn opts() -> Vec<Opt> {
    let base = Opt {
        rank: 4,
        alpha: 8.0,
        rslora: false,
        dora: false,
        dropout: 0.0,
        init: InitLoraWeights::Kaiming,
    };
    vec![
        base,
        Opt {
            alpha: 3.0,
            rank: 8,
            ..base
        },
        Opt {
            rslora: true,
            alpha: 6.0,
            ..base
        },
        Opt {
            init: InitLoraWeights::Gaussian,
            ..base
        },
        Opt {
            dropout: 0.5,
            ..base
        },
        Opt { dora: true, ..base },
        Opt {
            dora: true,
            dropout: 0.3,
            alpha: 2.0,
            ..base
        },
    ]
}

fn tol(site: Site) -> f64 {
    match site {
        Site::LinearBf16 => 0.05,
        _ => 1e-4,
    }
}

#[test]
fn invariant_table() {
    tch::set_num_threads(1);
    let mut checked = 0;
    for site in sites() {
        for o in opts() {
            let is_emb = matches!(site, Site::Embedding | Site::EmbeddingQ8);
            if o.dora && is_emb {
                // DoRA on embeddings is refused with an error naming the site
                let mut m = One::new(site);
                let vs = nn::VarStore::new(Device::Cpu);
                let cfg = cfg_for(&m, &o);
                let e = inject(&mut m, &cfg, "default", &vs.root()).unwrap_err();
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                continue;
            }
            check_case(site, o);
            checked += 1;
        }
    }
    assert_eq!(checked, 13 * 7 - 2 * 2);
}

fn check_case(site: Site, o: Opt) {
    let ctx = format!("{site:?} {o:?}");
    let mut m = One::new(site);
    let x = m.input();
    let y_base = m.forward(&x, false);
    let w_before = m.base_snapshot();
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = cfg_for(&m, &o);
    let report = inject(&mut m, &cfg, "default", &vs.root()).unwrap();

    // parameter count = formula
    assert_eq!(report.modules, vec![m.name.to_string()], "{ctx}");
    assert_eq!(
        report.params_added,
        m.param_formula(o.rank, o.dora),
        "{ctx}"
    );
    assert_eq!(report.trainable_params, report.params_added, "{ctx}");
    assert_eq!(
        report.all_params,
        m.layer().base().numel() + report.params_added + bias_numel(&m),
        "{ctx}"
    );
    let vs_count: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    assert_eq!(vs_count, report.params_added, "{ctx}");

    // B = 0 (A = 0 for embeddings) is the identity
    let y0 = m.forward(&x, false);
    let d = max_abs_diff(&y0.to_kind(Kind::Float), &y_base.to_kind(Kind::Float));
    if o.dora {
        assert!(d <= 1e-6, "{ctx}: identity off by {d}");
    } else {
        assert_eq!(d, 0.0, "{ctx}: identity");
    }
    // scaling from config
    let ad = m.layer().adapter("default").unwrap();
    let want_s = if o.rslora {
        o.alpha / (o.rank as f64).sqrt()
    } else {
        o.alpha / o.rank as f64
    };
    assert!((ad.scaling() - want_s).abs() < 1e-12, "{ctx}");

    // after an optimizer step only adapter tensors changed
    {
        let before: Vec<Tensor> = vs.trainable_variables().iter().map(|t| t.copy()).collect();
        let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
        let loss = m
            .forward(&x, true)
            .to_kind(Kind::Float)
            .pow_tensor_scalar(2)
            .mean(None);
        opt.backward_step(&loss);
        let after = vs.trainable_variables();
        assert!(
            before.iter().zip(&after).any(|(b, a)| !b.equal(a)),
            "{ctx}: no adapter tensor changed"
        );
        assert!(
            m.base_snapshot().equal(&w_before),
            "{ctx}: base weight changed"
        );
    }

    // a non-trivial adapter; the forward equals the formula (eval)
    randomize(&mut m, "default", 5);
    let y1 = m.forward(&x, false);
    let expect = if o.dora {
        m.dora_formula(&x, "default")
    } else {
        m.formula(&x, "default")
    };
    let d = max_abs_diff(&y1.to_kind(Kind::Float), &expect);
    assert!(d <= tol(site), "{ctx}: formula off by {d}");
    assert!(
        max_abs_diff(&y1.to_kind(Kind::Float), &y_base.to_kind(Kind::Float)) > 1e-3,
        "{ctx}: adapter has no effect"
    );

    // dropout only in training
    let y_eval2 = m.forward(&x, false);
    assert!(y_eval2.equal(&y1), "{ctx}: eval is not deterministic");
    let y_train = m.forward(&x, true);
    if o.dropout > 0.0 && !matches!(site, Site::Embedding | Site::EmbeddingQ8) {
        assert!(
            !y_train.equal(&y1),
            "{ctx}: dropout had no effect in training"
        );
    } else {
        assert!(
            y_train.equal(&y1),
            "{ctx}: training forward differs without dropout"
        );
    }

    // disable → base output; enable → adapter output again
    set_adapters_enabled(&mut m, false).unwrap();
    assert!(
        m.forward(&x, false).equal(&y_base),
        "{ctx}: disabled != base"
    );
    set_adapters_enabled(&mut m, true).unwrap();
    assert!(
        m.forward(&x, false).equal(&y1),
        "{ctx}: re-enabled != adapted"
    );

    // merge: merged == unmerged forward; unmerge restores the base
    if m.is_quant() {
        let e = merge_adapters(&mut m, None, true).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{ctx}: {e}");
    } else {
        assert_eq!(merge_adapters(&mut m, None, true).unwrap(), 1);
        assert!(m.layer().adapter("default").unwrap().is_merged());
        let ym = m.forward(&x, false);
        let d = max_abs_diff(&ym.to_kind(Kind::Float), &y1.to_kind(Kind::Float));
        assert!(d <= tol(site), "{ctx}: merged differs by {d}");
        // merging twice is a no-op
        merge_adapters(&mut m, None, true).unwrap();
        assert!(
            m.forward(&x, false).equal(&ym),
            "{ctx}: second merge changed the output"
        );
        unmerge_adapters(&mut m).unwrap();
        let dw = max_abs_diff(&m.base_snapshot(), &w_before);
        let wtol = if site == Site::LinearBf16 { 0.02 } else { 1e-6 };
        assert!(dw <= wtol, "{ctx}: unmerge left {dw}");
        let d = max_abs_diff(
            &m.forward(&x, false).to_kind(Kind::Float),
            &y1.to_kind(Kind::Float),
        );
        assert!(d <= tol(site), "{ctx}: unmerged forward off by {d}");
    }

    // save → load is bit-identical (PEFT layout)
    let dir = tempfile::tempdir().unwrap();
    peft::save_adapter(&mut m, "default", Some(&cfg), dir.path()).unwrap();
    let mut m2 = One::new(site);
    let vs2 = nn::VarStore::new(Device::Cpu);
    let (cfg2, rep2) = peft::load_adapter(&mut m2, dir.path(), "default", &vs2.root()).unwrap();
    assert_eq!(cfg2.use_dora, o.dora, "{ctx}");
    assert_eq!(rep2.params_added, report.params_added, "{ctx}");
    let (a1, a2) = (
        m.layer().adapter("default").unwrap(),
        m2.layer().adapter("default").unwrap(),
    );
    assert!(
        a1.lora_a().equal(a2.lora_a()) && a1.lora_b().equal(a2.lora_b()),
        "{ctx}: A/B not bit-identical"
    );
    assert_eq!(a1.magnitude().is_some(), a2.magnitude().is_some());
    if let (Some(p), Some(q)) = (a1.magnitude(), a2.magnitude()) {
        assert!(p.equal(q), "{ctx}: magnitude");
    }
    assert!(
        (a1.scaling() - a2.scaling()).abs() < 1e-12,
        "{ctx}: scaling"
    );
    // (m's base went through merge → unmerge, so compare with the merge tolerance)
    let d = max_abs_diff(
        &m2.forward(&x, false).to_kind(Kind::Float),
        &y1.to_kind(Kind::Float),
    );
    assert!(d <= tol(site), "{ctx}: loaded forward differs by {d}");
}

fn bias_numel(m: &One) -> i64 {
    match &m.layer {
        Layer::Lin(l) => l.bias().map_or(0, |b| b.numel() as i64),
        Layer::Conv(l) => l.bias().map_or(0, |b| b.numel() as i64),
        Layer::Emb(_) => 0,
    }
}

#[test]
fn safe_merge_refuses_non_finite_and_leaves_base_untouched() {
    let mut m = One::new(Site::Linear);
    let vs = nn::VarStore::new(Device::Cpu);
    inject(
        &mut m,
        &LoraConfig::new(4, 8.0, &["q_proj"]),
        "default",
        &vs.root(),
    )
    .unwrap();
    let w = m.base_snapshot();
    {
        let _g = tch::no_grad_guard();
        let mut b = m
            .layer()
            .adapter("default")
            .unwrap()
            .lora_b()
            .shallow_clone();
        let _ = b.fill_(f64::INFINITY);
        let mut a = m
            .layer()
            .adapter("default")
            .unwrap()
            .lora_a()
            .shallow_clone();
        let _ = a.fill_(1.0);
    }
    let e = merge_adapters(&mut m, None, true).unwrap_err();
    match e {
        Error::NonFinite { module, adapter } => {
            assert_eq!(module, "model.layers.0.self_attn.q_proj");
            assert_eq!(adapter, "default");
        }
        other => panic!("{other}"),
    }
    assert!(m.base_snapshot().equal(&w));
    assert!(!m.layer().adapter("default").unwrap().is_merged());
}

#[test]
fn several_named_adapters_with_weights() {
    let mut m = One::new(Site::LinearBias);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut c1 = LoraConfig::new(4, 8.0, &["up_proj"]);
    c1.init_lora_weights = InitLoraWeights::Random;
    let mut c2 = LoraConfig::new(2, 1.0, &["up_proj"]);
    c2.init_lora_weights = InitLoraWeights::Random;
    inject(&mut m, &c1, "style", &vs.root()).unwrap();
    inject(&mut m, &c2, "subject", &vs.root()).unwrap();
    // a duplicate name is refused
    let e = inject(&mut m, &c2, "subject", &vs.root()).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    lora_core::inject::set_adapter_weight(&mut m, "style", 0.5).unwrap();
    lora_core::inject::set_adapter_weight(&mut m, "subject", -2.0).unwrap();
    let x = m.input();
    let y = m.forward(&x, false);
    let Layer::Lin(l) = &m.layer else {
        unreachable!()
    };
    let w = l.base().weight(Kind::Float).unwrap();
    let branch = |name: &str| {
        let ad = l.adapter(name).unwrap();
        x.matmul(&ad.lora_a().tr()).matmul(&ad.lora_b().tr()) * (ad.scaling() * ad.weight())
    };
    let expect = x.matmul(&w.tr()) + l.bias().unwrap() + branch("style") + branch("subject");
    assert!(max_abs_diff(&y, &expect) < 1e-5);
    // only one adapter active
    lora_core::inject::set_adapter_enabled(&mut m, "subject", false).unwrap();
    let expect1 = x.matmul(&w.tr()) + l_bias(&m) + branch_of(&m, &x, "style");
    assert!(max_abs_diff(&m.forward(&x, false), &expect1) < 1e-5);
    lora_core::inject::set_adapter_enabled(&mut m, "subject", true).unwrap();
    // merging one adapter keeps the output
    merge_adapters(&mut m, Some(&["style"]), true).unwrap();
    assert!(max_abs_diff(&m.forward(&x, false), &y) < 1e-5);
    // a merged adapter's weight cannot change
    assert!(lora_core::inject::set_adapter_weight(&mut m, "style", 1.0).is_err());
    unmerge_adapters(&mut m).unwrap();
    assert!(max_abs_diff(&m.forward(&x, false), &y) < 1e-5);
    // LoRA+ groups: A of both adapters in `a`, B in `b`, ratio kept
    let g = lora_core::inject::param_groups(&mut m, None, 16.0).unwrap();
    assert_eq!((g.a.len(), g.b.len(), g.embedding.len()), (2, 2, 0));
    assert_eq!(g.a[0].size(), vec![4, IN]);
    assert_eq!(g.b[1].size(), vec![OUT, 2]);
    assert_eq!(g.lr_b(1e-4), 16.0 * 1e-4);
    let g = lora_core::inject::param_groups(&mut m, Some("subject"), 16.0).unwrap();
    assert_eq!((g.a.len(), g.b.len()), (1, 1));
    assert!(lora_core::inject::param_groups(&mut m, Some("nope"), 16.0).is_err());
    assert!(lora_core::inject::param_groups(&mut m, None, 0.0).is_err());
}

fn l_bias(m: &One) -> Tensor {
    let Layer::Lin(l) = &m.layer else {
        unreachable!()
    };
    l.bias().unwrap().shallow_clone()
}

fn branch_of(m: &One, x: &Tensor, name: &str) -> Tensor {
    let ad = m.layer().adapter(name).unwrap();
    x.matmul(&ad.lora_a().tr()).matmul(&ad.lora_b().tr()) * (ad.scaling() * ad.weight())
}

#[test]
fn lora_plus_groups_dora_magnitude_with_b_and_embeddings_apart() {
    let mut t = common::Tiny::new(None);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = LoraConfig::new(4, 4.0, &["q_proj", "embed_tokens", "conv_in"]);
    cfg.use_dora = false;
    inject(&mut t, &cfg, "default", &vs.root()).unwrap();
    let g = lora_core::inject::param_groups(&mut t, Some("default"), 8.0).unwrap();
    assert_eq!((g.a.len(), g.b.len(), g.embedding.len()), (2, 2, 2));
    let n: usize = g.all().iter().map(|t| t.numel()).sum();
    let vs_n: usize = vs.trainable_variables().iter().map(|t| t.numel()).sum();
    assert_eq!(n, vs_n);
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Any shape / rank / alpha: forward = formula, merged = unmerged, merge→unmerge restores,
        /// parameter count = r·(in + out).
        #[test]
        fn linear_any_shape(out in 1i64..40, in_blocks in 1i64..4, r in 1i64..9, alpha in 0.5f64..32.0,
                            batch in 1i64..4, rslora in any::<bool>(), quant in 0usize..3, seed in 0i64..1000) {
            let inn = in_blocks * 32;
            let w = dense(&[out, inn], seed);
            let base = match quant {
                0 => BaseWeight::Dense(w.copy()),
                1 => BaseWeight::Quant(QuantWeight::quantize(&w, QuantKind::Q4_1).unwrap()),
                _ => BaseWeight::Quant(QuantWeight::quantize(&w, QuantKind::Q8_0).unwrap()),
            };
            let mut m = One { name: "blk.proj", site: Site::Linear, layer: Layer::Lin(LoraLinear::new(base, Some(dense(&[out], seed + 1))).unwrap()) };
            let vs = nn::VarStore::new(Device::Cpu);
            let mut cfg = LoraConfig::new(r, alpha, &["proj"]);
            cfg.use_rslora = rslora;
            let rep = inject(&mut m, &cfg, "default", &vs.root()).unwrap();
            prop_assert_eq!(rep.params_added, r * (inn + out));
            randomize(&mut m, "default", seed);
            let x = dense(&[batch, inn], seed + 2);
            let y = m.forward(&x, false);
            let f = m.formula(&x, "default");
            prop_assert!(max_abs_diff(&y, &f) < 1e-4);
            if quant == 0 {
                let w0 = m.base_snapshot();
                merge_adapters(&mut m, None, true).unwrap();
                prop_assert!(max_abs_diff(&m.forward(&x, false), &y) < 1e-4);
                unmerge_adapters(&mut m).unwrap();
                prop_assert!(max_abs_diff(&m.base_snapshot(), &w0) < 1e-5);
            }
        }

        /// Conv2d with any kernel / stride / padding / rank.
        #[test]
        fn conv_any_shape(cin in 1i64..5, cout in 1i64..6, k in 1i64..4, stride in 1i64..3, pad in 0i64..2,
                          r in 1i64..5, seed in 0i64..1000) {
            let mut m = One {
                name: "conv",
                site: Site::Conv,
                layer: Layer::Conv(LoraConv2d::new(
                    BaseWeight::Dense(dense(&[cout, cin, k, k], seed)),
                    None,
                    Conv2dParams { stride: [stride, stride], padding: [pad, pad], ..Default::default() },
                ).unwrap()),
            };
            let vs = nn::VarStore::new(Device::Cpu);
            let rep = inject(&mut m, &LoraConfig::new(r, 2.0 * r as f64, &["conv"]), "default", &vs.root()).unwrap();
            prop_assert_eq!(rep.params_added, r * cin * k * k + cout * r);
            randomize(&mut m, "default", seed);
            let x = dense(&[2, cin, 5, 6], seed + 3);
            let y = m.forward(&x, false);
            prop_assert!(max_abs_diff(&y, &m.formula(&x, "default")) < 1e-4);
            merge_adapters(&mut m, None, false).unwrap();
            prop_assert!(max_abs_diff(&m.forward(&x, false), &y) < 1e-4);
        }
    }
}
