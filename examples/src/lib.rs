//! Runnable examples of the lora-sdk (`examples/README.md` lists them with their commands):
//!
//! - `own_model`: LoRA on an app's own tch model through the training engine alone ([`own_model`]);
//!   with `--no-default-features` this crate compiles no recipe, config file, plotting or image
//!   code;
//! - `plan_fit`, `finetune_smollm2`, `sd_lora`, `tag_folder`, `convert_adapter` (feature
//!   `recipes`, on by default): single-file programs in `src/bin/`.
#![deny(missing_docs)]

/// An app's own model trained with LoRA through [`lora_train::engine`]: a frozen two-layer MLP
/// built from lora-core's [`LoraLinear`](lora_train::core::linear::LoraLinear) layers, with a
/// rank-4 adapter on each, regressing a fixed random teacher. The engine knows nothing of the
/// model: it sees a [`TrainStep`](lora_train::engine::TrainStep) (loss + trainable tensors) and
/// a [`BatchSource`](lora_train::engine::BatchSource).
pub mod own_model {
    use lora_train::core::base::BaseWeight;
    use lora_train::core::config::AdapterSpec;
    use lora_train::core::layer::LoraLayer;
    use lora_train::core::linear::LoraLinear;
    use lora_train::engine::optim::{AdamWConfig, OptimizerKind};
    use lora_train::engine::{
        BatchSource, Result, Resume, TrainReport, TrainStep, Trainer, TrainerConfig,
    };
    use lora_train::tch::{self, Device, Kind, Tensor, nn};

    /// Input features of the MLP.
    pub const IN: i64 = 16;
    /// Hidden features.
    pub const HIDDEN: i64 = 64;
    /// Output features.
    pub const OUT: i64 = 8;

    /// A frozen MLP `y = W₂·gelu(W₁·x)` with a LoRA adapter on both layers.
    #[derive(Debug)]
    pub struct Mlp {
        fc1: LoraLinear,
        fc2: LoraLinear,
        /// The adapters' tensors (`lora_A`/`lora_B` of both layers).
        pub adapters: nn::VarStore,
    }

    impl Mlp {
        /// Random frozen weights (seeded), adapters of rank `rank` and alpha `2·rank`.
        ///
        /// # Errors
        /// lora-core errors (a bad rank), as [`lora_train::engine::TrainError::Lora`].
        pub fn new(rank: i64) -> Result<Self> {
            tch::manual_seed(7);
            let w1 =
                Tensor::f_randn([HIDDEN, IN], (Kind::Float, Device::Cpu))? / (IN as f64).sqrt();
            let w2 = Tensor::f_randn([OUT, HIDDEN], (Kind::Float, Device::Cpu))?
                / (HIDDEN as f64).sqrt();
            let mut fc1 = LoraLinear::new(BaseWeight::Dense(w1), None)?;
            let mut fc2 = LoraLinear::new(BaseWeight::Dense(w2), None)?;
            let adapters = nn::VarStore::new(Device::Cpu);
            let spec = AdapterSpec::new(rank, 2.0 * rank as f64);
            let root = adapters.root();
            fc1.add_adapter("fc1", "default", &spec, &root)?;
            fc2.add_adapter("fc2", "default", &spec, &root)?;
            Ok(Self { fc1, fc2, adapters })
        }

        /// `[batch, IN]` → `[batch, OUT]`.
        ///
        /// # Errors
        /// lora-core and libtorch errors.
        pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
            let h = self.fc1.forward_t(x, train)?.f_gelu("none")?;
            Ok(self.fc2.forward_t(&h, train)?)
        }
    }

    /// The engine's view of the model: mean squared error against the teacher's outputs.
    impl TrainStep for Mlp {
        type Batch = (Tensor, Tensor);

        fn loss(&mut self, (x, y): &Self::Batch, train: bool) -> Result<Tensor> {
            Ok(self
                .forward(x, train)?
                .f_mse_loss(y, tch::Reduction::Mean)?)
        }

        fn named_trainable(&self) -> Vec<(String, Tensor)> {
            let mut v: Vec<(String, Tensor)> = self.adapters.variables().into_iter().collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        }

        fn micro_batch_len(&self, (x, _): &Self::Batch) -> usize {
            x.size()[0] as usize
        }
    }

    /// A fixed in-memory dataset: `batches` batches of `batch` inputs and a teacher's outputs
    /// (the frozen MLP with other, seeded weights), the same order every epoch.
    #[derive(Debug)]
    pub struct Teacher {
        data: Vec<(Tensor, Tensor)>,
        next: usize,
    }

    impl Teacher {
        /// # Errors
        /// libtorch errors.
        pub fn new(batches: usize, batch: i64) -> Result<Self> {
            tch::manual_seed(11);
            let t1 =
                Tensor::f_randn([HIDDEN, IN], (Kind::Float, Device::Cpu))? / (IN as f64).sqrt();
            let t2 = Tensor::f_randn([OUT, HIDDEN], (Kind::Float, Device::Cpu))?
                / (HIDDEN as f64).sqrt();
            let mut data = Vec::with_capacity(batches);
            for _ in 0..batches {
                let x = Tensor::f_randn([batch, IN], (Kind::Float, Device::Cpu))?;
                let y = x
                    .f_matmul(&t1.f_transpose(0, 1)?)?
                    .f_gelu("none")?
                    .f_matmul(&t2.f_transpose(0, 1)?)?;
                data.push((x, y));
            }
            Ok(Self { data, next: 0 })
        }
    }

    impl BatchSource<(Tensor, Tensor)> for Teacher {
        fn start_epoch(&mut self, _epoch: u64) -> Result<()> {
            self.next = 0;
            Ok(())
        }

        fn next_batch(&mut self) -> Result<Option<(Tensor, Tensor)>> {
            let b = self
                .data
                .get(self.next)
                .map(|(x, y)| (x.shallow_clone(), y.shallow_clone()));
            self.next += 1;
            Ok(b)
        }

        fn batches_per_epoch(&self) -> Option<u64> {
            Some(self.data.len() as u64)
        }

        fn state(&self) -> serde_json::Value {
            serde_json::json!({ "next": self.next })
        }

        fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
            self.next = state["next"].as_u64().unwrap_or(0) as usize;
            Ok(())
        }
    }

    /// Trains the adapters for `steps` AdamW steps (lr 1e-2, batches of 32) and returns the
    /// mean loss over the data before and after, and the engine's report.
    ///
    /// # Errors
    /// Engine and libtorch errors.
    pub fn run(steps: u64) -> Result<(f64, f64, TrainReport)> {
        let mut model = Mlp::new(4)?;
        let mut data = Teacher::new(8, 32)?;
        let mean_loss = |model: &mut Mlp, data: &Teacher| -> Result<f64> {
            let _g = tch::no_grad_guard();
            let mut total = 0.0;
            for b in &data.data {
                total += model.loss(b, false)?.f_double_value(&[])?;
            }
            Ok(total / data.data.len() as f64)
        };
        let before = mean_loss(&mut model, &data)?;
        let cfg = TrainerConfig {
            lr: 1e-2,
            optimizer: OptimizerKind::AdamW(AdamWConfig::default()),
            epochs: u64::MAX,
            max_steps: Some(steps),
            ..TrainerConfig::default()
        };
        let mut trainer: Trainer<Mlp> = Trainer::new(cfg);
        let report = trainer.fit(&mut model, &mut data, Resume::No)?;
        let after = mean_loss(&mut model, &data)?;
        Ok((before, after, report))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_engine_trains_an_apps_own_model() {
            let (before, after, report) = super::run(40).unwrap();
            assert_eq!(report.steps, 40);
            assert!(
                after < 0.5 * before,
                "mean loss {before:.4} → {after:.4} should at least halve"
            );
        }
    }
}
