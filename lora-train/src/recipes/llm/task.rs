//! The causal-LM base loaded, its training step and its batch source.

use super::*;

/// Loads a LLaMA-family base and its tokenizer from a GGUF file or an HF folder.
///
/// # Errors
/// [`JobError::Input`] for a damaged file or one this tool does not read (with what to do);
/// [`JobError::Model`] naming the file for other loader errors (out of memory, …).
pub fn load_base(
    path: &Path,
    weights: BaseWeights,
    dtype: Dtype,
    device: tch::Device,
) -> Result<(lora_models::llama::Llama, lora_models::tokenizer::Tokenizer)> {
    use lora_models::llama::{Llama, WeightMode};
    let kind = match dtype {
        Dtype::F32 => tch::Kind::Float,
        Dtype::Bf16 => tch::Kind::BFloat16,
        Dtype::F16 => tch::Kind::Half,
    };
    let mode = match weights {
        BaseWeights::Dense => WeightMode::Dense(kind),
        BaseWeights::Quantized => WeightMode::KeepQuantized,
    };
    let ctx = format!("loading {}", path.display());
    // A malformed file is bad input (exit 2 in the CLI), named with what to do; a libtorch
    // failure while loading (out of memory, …) stays a runtime error.
    let load_err = |ctx: &str| {
        let ctx = ctx.to_string();
        move |e: lora_models::Error| {
            use lora_models::Error as M;
            match e {
                M::Gguf { .. }
                | M::Safetensors { .. }
                | M::Metadata { .. }
                | M::MissingTensor { .. }
                | M::Shape { .. }
                | M::Config { .. }
                | M::Unsupported { .. } => {
                    let text = e.to_string();
                    JobError::Input(if text.contains("truncated") {
                        // the message says what happened and what to do
                        text
                    } else {
                        format!(
                            "{text}; the file is damaged (a truncated download?) or not a model \
                             this tool reads — check its size and checksum, or download it again"
                        )
                    })
                }
                other => JobError::Model {
                    during: ctx.clone(),
                    source: other,
                },
            }
        }
    };
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let model = Llama::from_gguf(path, mode, device).map_err(load_err(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer_from_gguf(path).map_err(load_err(&ctx))?;
        Ok((model, tok))
    } else {
        let model = Llama::from_safetensors(path, mode, device).map_err(load_err(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer(path.join("tokenizer.json"))
            .map_err(load_err(&ctx))?;
        Ok((model, tok))
    }
}

/// The causal-LM [`crate::engine::TrainStep`]: a LLaMA-family model with LoRA adapters and
/// packed text batches; loss = mean next-token NLL over labels ≠ −100 ([`lora_models::llama::Llama::loss`]).
pub struct LlamaTask<'a> {
    /// The model (adapters injected).
    pub model: &'a lora_models::llama::Llama,
    /// Adapter tensors by VarStore name (`<module>.lora_A.default.weight`, …), sorted.
    pub named: Vec<(String, tch::Tensor)>,
    /// LoRA+ ratio for the B matrices, if any.
    pub loraplus_lr_ratio: Option<f64>,
}

impl crate::engine::TrainStep for LlamaTask<'_> {
    type Batch = lora_data::text::TextBatch;

    fn loss(&mut self, b: &Self::Batch, train: bool) -> crate::engine::Result<tch::Tensor> {
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss(&ids, &labels, Some(&mask), Some(&pos), train)
            .map_err(crate::job::error::model_step_err)
    }

    /// With gradient checkpointing on, the model recomputes each decoder layer during backward
    /// ([`Llama::loss_backward`](lora_models::llama::Llama::loss_backward)); otherwise the
    /// trainer's plain path runs.
    fn loss_backward(
        &mut self,
        b: &Self::Batch,
        scale: f64,
    ) -> crate::engine::Result<Option<tch::Tensor>> {
        if !self.model.gradient_checkpointing() {
            return Ok(None);
        }
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss_backward(&ids, &labels, Some(&mask), Some(&pos), true, scale)
            .map(Some)
            .map_err(crate::job::error::model_step_err)
    }

    fn named_trainable(&self) -> Vec<(String, tch::Tensor)> {
        self.named
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn param_groups(&self) -> Vec<crate::engine::optim::ParamGroup> {
        crate::engine::optim::adapter_groups(self.named_trainable(), self.loraplus_lr_ratio)
    }

    fn micro_batch_len(&self, b: &Self::Batch) -> usize {
        b.input_ids.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(
        &self,
        b: &Self::Batch,
        parts: usize,
    ) -> crate::engine::Result<Vec<Self::Batch>> {
        let n = parts.max(1) as i64;
        let ids = b.input_ids.f_chunk(n, 0)?;
        let labels = b.labels.f_chunk(n, 0)?;
        let mask = b.attention_mask.f_chunk(n, 0)?;
        let pos = b.position_ids.f_chunk(n, 0)?;
        let docs = match &b.doc_ids {
            Some(t) => Some(t.f_chunk(n, 0)?),
            None => None,
        };
        let mut out = Vec::new();
        for i in 0..ids.len() {
            out.push(lora_data::text::TextBatch {
                input_ids: ids[i].shallow_clone(),
                labels: labels[i].shallow_clone(),
                attention_mask: mask[i].shallow_clone(),
                position_ids: pos[i].shallow_clone(),
                doc_ids: docs.as_ref().map(|d| d[i].shallow_clone()),
            });
        }
        Ok(out)
    }

    fn batch_tokens(&self, b: &Self::Batch) -> u64 {
        b.attention_mask
            .f_sum(tch::Kind::Int64)
            .and_then(|t| t.f_int64_value(&[]))
            .unwrap_or(0)
            .max(0) as u64
    }
}

/// The trainer's batch source over lora-data's text loader: the loader's seeded per-epoch plan,
/// batches built by its workers ahead of use (in the training thread with 0 workers); the
/// position (epoch, batch index) is checkpointed.
pub struct TextSource {
    loader: lora_data::loader::Loader<lora_data::text::TextDataset, lora_data::text::TextCollate>,
    batches: Option<lora_data::loader::Batches<lora_data::text::TextBatch>>,
    epoch: u64,
}

impl TextSource {
    /// Wraps a loader; its workers (`data_loader.num_workers`, `prefetch_factor`,
    /// `persistent_workers`) build batches ahead of the training step.
    pub fn new(
        loader: lora_data::loader::Loader<
            lora_data::text::TextDataset,
            lora_data::text::TextCollate,
        >,
    ) -> Self {
        TextSource {
            loader,
            batches: None,
            epoch: 0,
        }
    }
}

fn data_err(e: lora_data::Error) -> crate::engine::TrainError {
    crate::engine::TrainError::App(format!("data: {e}"))
}

impl crate::engine::BatchSource<lora_data::text::TextBatch> for TextSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::engine::Result<()> {
        self.batches = Some(self.loader.batches(epoch, 0));
        self.epoch = epoch;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::engine::Result<Option<lora_data::text::TextBatch>> {
        match self.batches.as_mut().and_then(Iterator::next) {
            Some(b) => b.map(Some).map_err(data_err),
            None => Ok(None),
        }
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        let next = self
            .batches
            .as_ref()
            .map_or(0, lora_data::loader::Batches::position);
        serde_json::json!({
            "epoch": self.epoch,
            "next": next,
            "rows": lora_data::loader::Dataset::len(self.loader.dataset()),
            "num_replicas": self.loader.config().num_replicas,
        })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::engine::Result<()> {
        let bad = |m: &str| crate::engine::TrainError::State {
            what: "loader position".into(),
            message: m.into(),
        };
        let rows = state["rows"].as_u64().ok_or_else(|| bad("no row count"))?;
        if rows != lora_data::loader::Dataset::len(self.loader.dataset()) as u64 {
            return Err(bad(&format!(
                "the checkpoint was taken over {rows} rows, this dataset has {}; resume with the same data and seq_len",
                lora_data::loader::Dataset::len(self.loader.dataset())
            )));
        }
        let epoch = state["epoch"].as_u64().ok_or_else(|| bad("no epoch"))?;
        let next = state["next"]
            .as_u64()
            .ok_or_else(|| bad("no batch index"))? as usize;
        // written by another number of data-parallel ranks: the same place in the epoch's plan
        let saved_replicas = state["num_replicas"].as_u64().unwrap_or(1) as usize;
        let next = lora_data::loader::replica_position(
            next,
            saved_replicas,
            self.loader.config().num_replicas,
        );
        self.batches = Some(self.loader.batches(epoch, next));
        self.epoch = epoch;
        Ok(())
    }
}
