//! Loads the SmolLM2-135M-Instruct GGUF three ways, prints the weights' resident memory of each,
//! the held-out-style perplexity of a sentence, and a greedy ChatML answer.
//!
//! `cargo run -p lora-models --example smollm2 [-- path/to/model.gguf "question"]`

use lora_models::gguf::GgufFile;
use lora_models::llama::{GenerateOptions, Llama, WeightMode};
use lora_models::tokenizer::{ChatMessage, ChatTemplate, tokenizer_from_gguf};
use tch::{Device, Kind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::set_num_threads(2);
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../assets/models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .to_string()
    });
    let question = args
        .next()
        .unwrap_or_else(|| "What is the capital of France?".to_string());
    let file = GgufFile::open(&path)?;
    let tok = tokenizer_from_gguf(&file)?;
    let template = ChatTemplate::from_gguf(&file)?.unwrap_or_else(ChatTemplate::chatml);
    let sentence = tok.encode(
        "The quick brown fox jumps over the lazy dog. It was a sunny day and the children were playing in the park.",
        true,
    )?;
    for mode in [
        WeightMode::KeepQuantized,
        WeightMode::Dense(Kind::BFloat16),
        WeightMode::Dense(Kind::Float),
    ] {
        let t0 = std::time::Instant::now();
        let model = Llama::from_gguf_file(&file, mode, Device::Cpu)?;
        let load_s = t0.elapsed().as_secs_f64();
        let bytes = model.weights_resident_bytes();
        let mut ppl = model.perplexity_ids(&sentence, &Default::default())?; // warm-up
        let t1 = std::time::Instant::now();
        for _ in 0..3 {
            ppl = model.perplexity_ids(&sentence, &Default::default())?;
        }
        let fwd_s = t1.elapsed().as_secs_f64() / 3.0;
        println!(
            "{mode:?}: weights resident {bytes} B = {:.1} MiB ({:.2} B/param), load {load_s:.1} s, \
             mean NLL {:.4} (ppl {:.2}) in {:.0} ms per 24-token forward",
            bytes as f64 / 1048576.0,
            bytes as f64 / model.num_params() as f64,
            ppl.mean_nll,
            ppl.perplexity,
            fwd_s * 1e3
        );
        if mode == WeightMode::KeepQuantized {
            let opts = GenerateOptions {
                max_new_tokens: 64,
                ..Default::default()
            };
            let answer = model.chat(
                &tok,
                &template,
                &[ChatMessage::user(question.clone())],
                &opts,
            )?;
            println!("Q: {question}\nA: {answer}");
        }
    }
    Ok(())
}
