//! A parallel, resumable data loader with bounded prefetch.
//!
//! The semantics follow PyTorch's `torch.utils.data.DataLoader` (`num_workers`, `prefetch_factor`,
//! `persistent_workers`): with `num_workers = n > 0`, batch `k` of an epoch is built by worker
//! `k mod n`, each worker keeps at most `prefetch_factor` finished batches waiting, and the consumer
//! receives batches strictly in order `0, 1, 2, …`. Batches are handed over channels because
//! `tch::Tensor` is `Send` but not `Sync`.
//!
//! The order of an epoch is a pure function of `(seed, epoch)` ([`Loader::plan`]): indices are
//! shuffled, grouped by [`Dataset::group`] (aspect or length bucket, as kohya's bucket batching
//! does), cut into batches within each group, and the batches shuffled. Resuming from
//! [`LoaderState`] `{ epoch, step, seed }` recomputes the plan and starts at batch `step`: nothing
//! of the epoch is loaded again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};

use crate::rng::{Rng, mix};
use crate::{Error, Result};

/// A random-access collection of samples.
///
/// Implementations must be cheap to share between worker threads (`Send + Sync`); `get` is called
/// concurrently from several threads.
pub trait Dataset: Send + Sync + 'static {
    /// One sample (e.g. token ids of a packed row, or a decoded image with its caption).
    type Item: Send + 'static;

    /// Number of samples.
    fn len(&self) -> usize;

    /// `true` when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`0..len()`).
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] or whatever reading/decoding the sample raises.
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// Sample `index` with randomness (augmentation, caption shuffling) drawn from `seed`. The loader
    /// passes a seed derived from `(seed, epoch, index)`, so an epoch is reproducible. Defaults to
    /// [`Dataset::get`].
    ///
    /// # Errors
    /// As [`Dataset::get`].
    fn get_seeded(&self, index: usize, seed: u64) -> Result<Self::Item> {
        let _ = seed;
        self.get(index)
    }

    /// Batches only hold samples of one group: an aspect-ratio bucket, a length bucket. Default 0
    /// (one group).
    fn group(&self, index: usize) -> u64 {
        let _ = index;
        0
    }
}

/// Turns a list of samples into one batch (stacking into tensors, padding).
pub trait Collate<I>: Send + Sync + 'static {
    /// The batch type.
    type Batch: Send + 'static;

    /// Builds a batch from `items` (in plan order, never empty).
    ///
    /// # Errors
    /// Tensor construction failures, inconsistent shapes.
    fn collate(&self, items: Vec<I>) -> Result<Self::Batch>;
}

/// Loader settings; names and defaults as PyTorch's `DataLoader` where one exists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoaderConfig {
    /// Samples per batch (the `micro_batch`). Default 1.
    pub batch_size: usize,
    /// Shuffle samples and batches each epoch. Default `true`.
    pub shuffle: bool,
    /// Drop the last incomplete batch of each group. Default `false`.
    pub drop_last: bool,
    /// Seed of the order and of per-sample randomness. Default 42.
    pub seed: u64,
    /// Worker threads; 0 loads in the consumer's thread. Default 2.
    pub num_workers: usize,
    /// Finished batches each worker may hold ahead of the consumer (≥ 1). Default 2.
    pub prefetch_factor: usize,
    /// Keep worker threads alive between epochs. Default `false`.
    pub persistent_workers: bool,
    /// Data-parallel replicas sharing each epoch (`torch.utils.data.DistributedSampler`'s
    /// `num_replicas`, the run's `world_size`): the epoch's batch plan is cut to a multiple of
    /// `num_replicas` batches (so every replica takes as many steps) and replica `rank` takes
    /// batches `rank, rank + num_replicas, …` of it. Default 1.
    pub num_replicas: usize,
    /// This replica's index in `0..num_replicas` (`DistributedSampler`'s `rank`). Default 0.
    pub rank: usize,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 1,
            shuffle: true,
            drop_last: false,
            seed: 42,
            num_workers: 2,
            prefetch_factor: 2,
            persistent_workers: false,
            num_replicas: 1,
            rank: 0,
        }
    }
}

/// The position in a data-parallel replica's share of an epoch (see
/// [`LoaderConfig::num_replicas`]) that `position` batches of a share among `from` replicas
/// correspond to among `to` replicas: the same place in the epoch's whole plan, `position ×
/// from` batches into it, rounded up to a whole round of `to` when it does not split evenly.
pub fn replica_position(position: usize, from: usize, to: usize) -> usize {
    let (from, to) = (from.max(1), to.max(1));
    (position * from).div_ceil(to)
}

/// Where the loader stands: the next batch to hand out is batch `step` of epoch `epoch`, in the order
/// given by `seed`. Serialize it with checkpoints; [`Loader::restore`] resumes there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epoch (0-based).
    pub epoch: u64,
    /// Batch index within the epoch (0-based) of the next batch.
    pub step: usize,
    /// Seed of the order.
    pub seed: u64,
}

struct Job<B> {
    plan: Arc<Vec<Vec<usize>>>,
    start: usize,
    epoch: u64,
    seed: u64,
    tx: SyncSender<Result<B>>,
}

struct Pool<B> {
    jobs: Vec<Sender<Job<B>>>,
    handles: Vec<JoinHandle<()>>,
}

impl<B> Drop for Pool<B> {
    /// Closes the job channels (workers exit after their current job, or at once when its
    /// stream is gone) and joins the workers.
    fn drop(&mut self) {
        self.jobs.clear();
        for h in self.handles.drain(..) {
            // A worker that panicked already reported through its closed channel.
            let _ = h.join();
        }
    }
}

/// The loader: a dataset, a collate function, a configuration and a position.
///
/// ```no_run
/// use lora_data::loader::{Collate, Dataset, Loader, LoaderConfig};
/// struct Squares;
/// impl Dataset for Squares {
///     type Item = u64;
///     fn len(&self) -> usize { 10 }
///     fn get(&self, i: usize) -> lora_data::Result<u64> { Ok((i * i) as u64) }
/// }
/// struct Sum;
/// impl Collate<u64> for Sum {
///     type Batch = u64;
///     fn collate(&self, items: Vec<u64>) -> lora_data::Result<u64> { Ok(items.iter().sum()) }
/// }
/// let config = LoaderConfig { batch_size: 4, ..LoaderConfig::default() };
/// let mut loader = Loader::new(Squares, Sum, config)?;
/// let mut epoch = loader.epoch();
/// while let Some(batch) = epoch.next() {
///     let _sum = batch?;
///     let _checkpoint = epoch.state(); // save this to resume after the batch just trained
/// }
/// # Ok::<(), lora_data::Error>(())
/// ```
pub struct Loader<D: Dataset, C: Collate<D::Item>> {
    dataset: Arc<D>,
    collate: Arc<C>,
    config: LoaderConfig,
    state: LoaderState,
    /// Persistent workers; every [`Batches`] served by them holds the pool too, so it is shut
    /// down (workers joined) only after the last stream is gone and no worker can be blocked
    /// handing a batch to a live stream.
    pool: Option<Arc<Pool<C::Batch>>>,
}

impl<D: Dataset, C: Collate<D::Item>> Loader<D, C> {
    /// A loader at epoch 0, step 0, seed `config.seed`.
    ///
    /// # Errors
    /// [`Error::Config`] when `batch_size` or `prefetch_factor` is 0.
    pub fn new(dataset: D, collate: C, config: LoaderConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(Error::config("batch_size", 0, "must be at least 1"));
        }
        if config.prefetch_factor == 0 {
            return Err(Error::config(
                "prefetch_factor",
                0,
                "must be at least 1 (batches each worker may prepare ahead)",
            ));
        }
        if config.num_replicas == 0 || config.rank >= config.num_replicas {
            return Err(Error::config(
                "rank",
                config.rank,
                format!(
                    "must be in 0..num_replicas ({}), and num_replicas at least 1",
                    config.num_replicas
                ),
            ));
        }
        let state = LoaderState {
            epoch: 0,
            step: 0,
            seed: config.seed,
        };
        Ok(Loader {
            dataset: Arc::new(dataset),
            collate: Arc::new(collate),
            config,
            state,
            pool: None,
        })
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The configuration.
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The position of the next batch.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Moves to `state` (e.g. from a checkpoint). The next [`Loader::epoch`] starts at batch
    /// `state.step` of epoch `state.epoch` in the order of `state.seed`; a `step` equal to the
    /// number of batches means the epoch is done and moves to the next epoch's step 0.
    ///
    /// # Errors
    /// [`Error::Config`] when `state.step` is beyond the number of batches of that epoch.
    pub fn restore(&mut self, state: LoaderState) -> Result<()> {
        let n = self.plan_for(state.seed, state.epoch).len();
        if state.step > n {
            return Err(Error::config(
                "step",
                state.step,
                format!(
                    "epoch {} has only {n} batches; was the checkpoint written with another \
                     dataset or batch_size?",
                    state.epoch
                ),
            ));
        }
        self.state = if state.step == n && n > 0 {
            LoaderState {
                epoch: state.epoch + 1,
                step: 0,
                seed: state.seed,
            }
        } else {
            state
        };
        Ok(())
    }

    /// Number of batches in an epoch (all epochs of a dataset have the same count).
    pub fn batches_per_epoch(&self) -> usize {
        self.plan_for(self.state.seed, 0).len()
    }

    /// The sample indices of every batch of `epoch`, in the order they are handed out.
    pub fn plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.plan_for(self.state.seed, epoch)
    }

    fn plan_for(&self, seed: u64, epoch: u64) -> Vec<Vec<usize>> {
        let n = self.dataset.len();
        let bs = self.config.batch_size;
        let mut rng = Rng::derived(&[seed, epoch, 0x006f_7264_6572]);
        let mut indices: Vec<usize> = (0..n).collect();
        if self.config.shuffle {
            rng.shuffle(&mut indices);
        }
        let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for i in indices {
            groups.entry(self.dataset.group(i)).or_default().push(i);
        }
        let mut batches = Vec::with_capacity(n.div_ceil(bs));
        for members in groups.into_values() {
            for chunk in members.chunks(bs) {
                if chunk.len() < bs && self.config.drop_last {
                    continue;
                }
                batches.push(chunk.to_vec());
            }
        }
        if self.config.shuffle {
            rng.shuffle(&mut batches);
        }
        let replicas = self.config.num_replicas.max(1);
        if replicas > 1 {
            // every replica draws the same plan; each keeps its share of the whole rounds
            batches.truncate(batches.len() / replicas * replicas);
            batches = batches
                .into_iter()
                .skip(self.config.rank)
                .step_by(replicas)
                .collect();
        }
        batches
    }

    /// Iterates over the rest of the current epoch, from the current step. When the iterator is
    /// exhausted the loader moves to the next epoch, step 0. Dropping it early keeps the position
    /// of the last batch handed out.
    pub fn epoch(&mut self) -> EpochIter<'_, D, C> {
        let batches = self.batches(self.state.epoch, self.state.step);
        EpochIter {
            loader: self,
            batches,
        }
    }

    /// The batches of `epoch` from batch `start` on (in the order of the loader's seed), built by
    /// the loader's workers ahead of use (`num_workers`, `prefetch_factor`, `persistent_workers`
    /// as in [`Loader::epoch`]) or, with no workers, in the caller's thread. Unlike
    /// [`Loader::epoch`] the stream owns what it needs and leaves the loader's position alone: a
    /// trainer's batch source keeps one beside the loader and records the position itself
    /// ([`Batches::position`]). A `start` past the end gives an empty stream.
    pub fn batches(&mut self, epoch: u64, start: usize) -> Batches<C::Batch> {
        let seed = self.state.seed;
        let plan = Arc::new(self.plan_for(seed, epoch));
        let start = start.min(plan.len());
        let n = self.config.num_workers;
        let mut receivers = Vec::new();
        let mut pool = None;
        if n > 0 && start < plan.len() {
            let p = if self.config.persistent_workers {
                if self.pool.is_none() {
                    self.pool = Some(Arc::new(self.spawn_pool()));
                }
                match &self.pool {
                    Some(p) => Arc::clone(p),
                    None => Arc::new(self.spawn_pool()),
                }
            } else {
                Arc::new(self.spawn_pool())
            };
            for (w, job_tx) in p.jobs.iter().enumerate() {
                let (tx, rx) = mpsc::sync_channel(self.config.prefetch_factor);
                let job = Job {
                    plan: Arc::clone(&plan),
                    start: start + w,
                    epoch,
                    seed,
                    tx,
                };
                // A send fails only when the worker is gone; the receive below reports it.
                let _ = job_tx.send(job);
                receivers.push(rx);
            }
            pool = Some(p);
        }
        let inline = receivers.is_empty().then(|| {
            let dataset = Arc::clone(&self.dataset);
            let collate = Arc::clone(&self.collate);
            Box::new(move |indices: &[usize]| {
                load_batch(&*dataset, &*collate, indices, seed, epoch)
            }) as InlineLoad<C::Batch>
        });
        Batches {
            plan,
            next: start,
            start,
            receivers,
            pool,
            inline,
        }
    }

    fn spawn_pool(&self) -> Pool<C::Batch> {
        let n = self.config.num_workers;
        // libtorch picks a thread's intra-op thread count on that thread's first parallel op, from
        // the last count set anywhere in the process; the workers set 1 (see `worker_loop`), so
        // the calling thread settles its own count first and keeps it.
        let _ = tch::get_num_threads();
        let mut jobs = Vec::with_capacity(n);
        let mut handles = Vec::with_capacity(n);
        for w in 0..n {
            let (job_tx, job_rx) = mpsc::channel::<Job<C::Batch>>();
            let dataset = Arc::clone(&self.dataset);
            let collate = Arc::clone(&self.collate);
            let stride = n;
            let spawned = std::thread::Builder::new()
                .name(format!("lora-data-worker-{w}"))
                .spawn(move || worker_loop(&*dataset, &*collate, job_rx, stride));
            match spawned {
                Ok(h) => {
                    jobs.push(job_tx);
                    handles.push(h);
                }
                Err(_) => {
                    // Could not start the thread: keep the channel so the consumer sees the worker
                    // as stopped and reports it with context.
                    jobs.push(job_tx);
                }
            }
        }
        Pool { jobs, handles }
    }
}

/// A worker's body. Like PyTorch's DataLoader workers (`torch.utils.data._utils.worker`, which
/// call `torch.set_num_threads(1)`), each worker runs libtorch on one intra-op thread: the
/// workers already run in parallel with each other and with training, and every collate op
/// waking an OpenMP team per worker would oversubscribe the cores.
fn worker_loop<D: Dataset, C: Collate<D::Item>>(
    dataset: &D,
    collate: &C,
    jobs: Receiver<Job<C::Batch>>,
    stride: usize,
) {
    tch::set_num_threads(1);
    for job in jobs {
        let mut k = job.start;
        while k < job.plan.len() {
            let batch = load_batch(dataset, collate, &job.plan[k], job.seed, job.epoch);
            if job.tx.send(batch).is_err() {
                break; // the consumer dropped this epoch
            }
            k += stride;
        }
    }
}

fn load_batch<D: Dataset, C: Collate<D::Item>>(
    dataset: &D,
    collate: &C,
    indices: &[usize],
    seed: u64,
    epoch: u64,
) -> Result<C::Batch> {
    let mut items = Vec::with_capacity(indices.len());
    for &i in indices {
        items.push(dataset.get_seeded(i, mix(&[seed, epoch, i as u64]))?);
    }
    collate.collate(items)
}

/// Builds a batch in the consumer's thread (no workers).
type InlineLoad<B> = Box<dyn Fn(&[usize]) -> Result<B> + Send>;

/// One epoch's batches from a start position, in order: see [`Loader::batches`]. Dropping it
/// makes the workers give up the rest of the epoch.
pub struct Batches<B> {
    plan: Arc<Vec<Vec<usize>>>,
    next: usize,
    start: usize,
    receivers: Vec<Receiver<Result<B>>>,
    /// The workers building this stream's batches (the loader's persistent pool, or a pool of
    /// this stream alone, whose workers exit once its jobs are done).
    pool: Option<Arc<Pool<B>>>,
    inline: Option<InlineLoad<B>>,
}

impl<B> Batches<B> {
    /// The index within the epoch of the batch the next call to `next` returns (the number of
    /// batches of the epoch handed out so far, counting those before the start).
    pub fn position(&self) -> usize {
        self.next
    }

    /// Number of batches in the epoch.
    pub fn epoch_len(&self) -> usize {
        self.plan.len()
    }

    /// Sample indices of the batch that the next call to `next` returns.
    pub fn peek_indices(&self) -> Option<&[usize]> {
        self.plan.get(self.next).map(Vec::as_slice)
    }

    /// Number of batches left.
    pub fn remaining(&self) -> usize {
        self.plan.len() - self.next
    }
}

impl<B> Iterator for Batches<B> {
    type Item = Result<B>;

    fn next(&mut self) -> Option<Self::Item> {
        let k = self.next;
        let indices = self.plan.get(k)?;
        let result = match &self.inline {
            Some(load) => load(indices),
            None => {
                let w = (k - self.start) % self.receivers.len();
                match self.receivers[w].recv() {
                    Ok(r) => r,
                    Err(_) => Err(Error::Worker {
                        worker: w,
                        step: k,
                        message: "the worker thread exited (a panic in Dataset::get or Collate?)"
                            .into(),
                    }),
                }
            }
        };
        self.next += 1;
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let r = self.remaining();
        (r, Some(r))
    }
}

impl<B> Drop for Batches<B> {
    fn drop(&mut self) {
        // Closing the result channels first makes blocked workers give up this epoch; then the
        // pool goes (joined here when this stream held it last).
        self.receivers.clear();
        self.pool = None;
    }
}

/// The batches of one epoch, in order, moving the loader's position as they are handed out.
/// See [`Loader::epoch`].
pub struct EpochIter<'a, D: Dataset, C: Collate<D::Item>> {
    loader: &'a mut Loader<D, C>,
    batches: Batches<C::Batch>,
}

impl<D: Dataset, C: Collate<D::Item>> EpochIter<'_, D, C> {
    /// The position after the last batch handed out: save it with a checkpoint written after
    /// training on that batch.
    pub fn state(&self) -> LoaderState {
        self.loader.state
    }

    /// Sample indices of the batch that the next call to `next` returns.
    pub fn peek_indices(&self) -> Option<&[usize]> {
        self.batches.peek_indices()
    }

    /// Number of batches left in this epoch.
    pub fn remaining(&self) -> usize {
        self.batches.remaining()
    }
}

impl<D: Dataset, C: Collate<D::Item>> Iterator for EpochIter<'_, D, C> {
    type Item = Result<C::Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        let result = self.batches.next()?;
        let next = self.batches.position();
        let st = &mut self.loader.state;
        if next >= self.batches.epoch_len() {
            st.epoch += 1;
            st.step = 0;
        } else {
            st.step = next;
        }
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.batches.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Numbers {
        n: usize,
        loads: Arc<AtomicUsize>,
        groups: u64,
    }
    impl Dataset for Numbers {
        type Item = (usize, u64);
        fn len(&self) -> usize {
            self.n
        }
        fn get(&self, index: usize) -> Result<(usize, u64)> {
            self.get_seeded(index, 0)
        }
        fn get_seeded(&self, index: usize, seed: u64) -> Result<(usize, u64)> {
            if index >= self.n {
                return Err(Error::IndexOutOfRange { index, len: self.n });
            }
            self.loads.fetch_add(1, Ordering::SeqCst);
            Ok((index, seed))
        }
        fn group(&self, index: usize) -> u64 {
            index as u64 % self.groups
        }
    }
    struct Ids;
    impl Collate<(usize, u64)> for Ids {
        type Batch = Vec<(usize, u64)>;
        fn collate(&self, items: Vec<(usize, u64)>) -> Result<Self::Batch> {
            Ok(items)
        }
    }

    fn loader(
        n: usize,
        groups: u64,
        config: LoaderConfig,
    ) -> (Loader<Numbers, Ids>, Arc<AtomicUsize>) {
        let loads = Arc::new(AtomicUsize::new(0));
        let ds = Numbers {
            n,
            loads: Arc::clone(&loads),
            groups,
        };
        (Loader::new(ds, Ids, config).unwrap(), loads)
    }

    fn collect(l: &mut Loader<Numbers, Ids>) -> Vec<Vec<(usize, u64)>> {
        l.epoch().map(|b| b.unwrap()).collect()
    }

    #[test]
    fn plan_covers_every_index_once_and_groups_are_pure() {
        let cfg = LoaderConfig {
            batch_size: 3,
            ..LoaderConfig::default()
        };
        let (l, _) = loader(20, 3, cfg);
        let plan = l.plan(0);
        let mut all: Vec<usize> = plan.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..20).collect::<Vec<_>>());
        for b in &plan {
            assert!(b.iter().all(|i| i % 3 == b[0] % 3), "mixed groups in {b:?}");
        }
        // group sizes 7, 7, 6 → 3+3+2 batches each
        assert_eq!(plan.len(), 3 + 3 + 2);
        assert_ne!(l.plan(0), l.plan(1), "epochs must differ");
        assert_eq!(l.plan(1), l.plan(1));
    }

    #[test]
    fn workers_return_the_plan_in_order_with_any_worker_count() {
        let base = LoaderConfig {
            batch_size: 4,
            num_workers: 0,
            ..LoaderConfig::default()
        };
        let (mut l0, _) = loader(50, 1, base.clone());
        let want = collect(&mut l0);
        assert_eq!(l0.state().epoch, 1);
        for (workers, persistent) in [(1, false), (3, false), (3, true), (8, true)] {
            let cfg = LoaderConfig {
                num_workers: workers,
                persistent_workers: persistent,
                prefetch_factor: 1,
                ..base.clone()
            };
            let (mut l, _) = loader(50, 1, cfg);
            assert_eq!(collect(&mut l), want, "{workers} workers");
            // second epoch: same as the single-threaded second epoch
            let second = collect(&mut l);
            let (mut l1, _) = loader(50, 1, base.clone());
            l1.restore(LoaderState {
                epoch: 1,
                step: 0,
                seed: 42,
            })
            .unwrap();
            assert_eq!(second, collect(&mut l1));
            assert_ne!(second, want);
        }
        let idx: Vec<usize> = want.iter().flatten().map(|x| x.0).collect();
        assert_eq!(
            want[0][0].1,
            mix(&[42, 0, idx[0] as u64]),
            "per-item seed is derived from (seed, epoch, index)"
        );
    }

    #[test]
    fn owned_batches_follow_the_plan_from_any_start_and_leave_the_position_alone() {
        let base = LoaderConfig {
            batch_size: 3,
            num_workers: 0,
            ..LoaderConfig::default()
        };
        let (mut l0, _) = loader(40, 2, base.clone());
        let second_epoch: Vec<_> = {
            l0.restore(LoaderState {
                epoch: 1,
                step: 0,
                seed: 42,
            })
            .unwrap();
            collect(&mut l0)
        };
        for (workers, persistent) in [(0, false), (2, false), (3, true)] {
            let cfg = LoaderConfig {
                num_workers: workers,
                persistent_workers: persistent,
                ..base.clone()
            };
            let (mut l, loads) = loader(40, 2, cfg);
            let mut b = l.batches(1, 5);
            assert_eq!(b.position(), 5);
            assert_eq!(b.epoch_len(), second_epoch.len());
            assert_eq!(b.peek_indices().unwrap().len(), second_epoch[5].len());
            let got: Vec<_> = b.by_ref().map(|x| x.unwrap()).collect();
            assert_eq!(got, second_epoch[5..], "{workers} workers");
            assert_eq!(b.position(), second_epoch.len());
            assert_eq!(b.remaining(), 0);
            // only the batches from the start were loaded
            let tail_items: usize = second_epoch[5..].iter().map(Vec::len).sum();
            assert_eq!(loads.load(Ordering::SeqCst), tail_items);
            assert_eq!(l.state().epoch, 0, "the loader's own position is untouched");
            // dropping a stream early, then starting another, is clean
            let mut early = l.batches(1, 0);
            early.next().unwrap().unwrap();
            drop(early);
            assert!(l.batches(1, second_epoch.len() + 3).next().is_none());
        }
    }

    #[test]
    fn a_stream_outlives_its_loader_without_blocking_the_drop() {
        // persistent workers, each blocked handing over its second batch (prefetch 1) when the
        // loader goes: the drop must not wait for them, and the stream still ends in plan order
        for persistent in [true, false] {
            let cfg = LoaderConfig {
                batch_size: 2,
                num_workers: 2,
                prefetch_factor: 1,
                persistent_workers: persistent,
                ..LoaderConfig::default()
            };
            let (mut l, _) = loader(24, 1, cfg.clone());
            let plan = l.plan(0);
            let mut b = l.batches(0, 0);
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(l);
            let got: Vec<Vec<usize>> = b
                .by_ref()
                .map(|x| x.unwrap().into_iter().map(|(i, _)| i).collect())
                .collect();
            assert_eq!(got, plan, "persistent {persistent}");
            // and a stream dropped with workers blocked is released too
            let (mut l, _) = loader(24, 1, cfg);
            let mut b = l.batches(0, 0);
            b.next().unwrap().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(b);
            drop(l);
        }
    }

    #[test]
    fn replicas_split_the_plan_into_equal_disjoint_shares() {
        let base = LoaderConfig {
            batch_size: 3,
            num_workers: 0,
            ..LoaderConfig::default()
        };
        // 29 items in groups of 10, 10, 9 → 4 + 4 + 3 = 11 batches; 2 replicas take 5 each,
        // the 11th is dropped
        let (l, _) = loader(29, 3, base.clone());
        let whole = l.plan(4);
        assert_eq!(whole.len(), 11);
        let shares: Vec<Vec<Vec<usize>>> = (0..2)
            .map(|rank| {
                let cfg = LoaderConfig {
                    num_replicas: 2,
                    rank,
                    ..base.clone()
                };
                loader(29, 3, cfg).0.plan(4)
            })
            .collect();
        assert_eq!(shares[0].len(), 5);
        assert_eq!(shares[1].len(), 5);
        for k in 0..5 {
            assert_eq!(shares[0][k], whole[2 * k]);
            assert_eq!(shares[1][k], whole[2 * k + 1]);
        }
        let cfg = LoaderConfig {
            num_replicas: 2,
            rank: 2,
            ..base
        };
        assert!(
            Loader::new(
                Numbers {
                    n: 4,
                    loads: Arc::default(),
                    groups: 1
                },
                Ids,
                cfg
            )
            .is_err()
        );
    }

    #[test]
    fn resume_mid_epoch_does_not_replay_and_matches_the_tail() {
        let cfg = LoaderConfig {
            batch_size: 2,
            num_workers: 2,
            prefetch_factor: 2,
            ..LoaderConfig::default()
        };
        let (mut full, _) = loader(30, 1, cfg.clone());
        let all = collect(&mut full);
        let (mut first, _) = loader(30, 1, cfg.clone());
        let state = {
            let mut it = first.epoch();
            for _ in 0..6 {
                it.next().unwrap().unwrap();
            }
            it.state()
        };
        assert_eq!(
            state,
            LoaderState {
                epoch: 0,
                step: 6,
                seed: 42
            }
        );
        let json = serde_json::to_string(&state).unwrap();
        let restored: LoaderState = serde_json::from_str(&json).unwrap();
        let (mut resumed, loads) = loader(30, 1, cfg);
        resumed.restore(restored).unwrap();
        let tail = collect(&mut resumed);
        assert_eq!(tail, all[6..].to_vec());
        assert_eq!(
            loads.load(Ordering::SeqCst),
            30 - 12,
            "only the rest is loaded"
        );
        assert!(
            resumed
                .restore(LoaderState {
                    epoch: 0,
                    step: 99,
                    seed: 42
                })
                .is_err()
        );
    }

    #[test]
    fn persistent_workers_follow_a_restored_seed_and_finished_epochs_roll_over() {
        let cfg = LoaderConfig {
            batch_size: 3,
            num_workers: 2,
            persistent_workers: true,
            ..LoaderConfig::default()
        };
        let (mut l, _) = loader(12, 1, cfg.clone());
        let _ = collect(&mut l); // workers now exist, spawned under seed 42
        let st = LoaderState {
            epoch: 3,
            step: 0,
            seed: 7,
        };
        l.restore(st).unwrap();
        let got = collect(&mut l);
        let (mut fresh, _) = loader(
            12,
            1,
            LoaderConfig {
                num_workers: 0,
                ..cfg
            },
        );
        fresh.restore(st).unwrap();
        assert_eq!(got, collect(&mut fresh));
        assert_eq!(got[0][0].1, mix(&[7, 3, got[0][0].0 as u64]));
        l.restore(LoaderState {
            epoch: 5,
            step: 4,
            seed: 7,
        })
        .unwrap();
        assert_eq!(
            l.state(),
            LoaderState {
                epoch: 6,
                step: 0,
                seed: 7
            }
        );
    }

    #[test]
    fn prefetch_is_bounded() {
        let cfg = LoaderConfig {
            batch_size: 1,
            num_workers: 2,
            prefetch_factor: 2,
            shuffle: false,
            ..LoaderConfig::default()
        };
        let (mut l, loads) = loader(100, 1, cfg);
        let mut it = l.epoch();
        it.next().unwrap().unwrap();
        // wait (up to 10 s on a loaded machine) until the workers have filled their queues
        let t = std::time::Instant::now();
        while loads.load(Ordering::SeqCst) < 1 + 2 * 2 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        // each worker: ≤ prefetch_factor queued + 1 blocked in send; consumer took 1
        let loaded = loads.load(Ordering::SeqCst);
        assert!(loaded <= 1 + 2 * (2 + 1), "loaded {loaded}");
        assert!(loaded >= 3, "workers should prefetch, loaded {loaded}");
        drop(it);
        assert_eq!(l.state().step, 1);
    }

    #[test]
    fn drop_last_and_config_errors() {
        let cfg = LoaderConfig {
            batch_size: 4,
            drop_last: true,
            num_workers: 0,
            ..LoaderConfig::default()
        };
        let (l, _) = loader(10, 1, cfg.clone());
        assert_eq!(l.batches_per_epoch(), 2);
        let ds = Numbers {
            n: 1,
            loads: Arc::new(AtomicUsize::new(0)),
            groups: 1,
        };
        let bad = LoaderConfig {
            batch_size: 0,
            ..cfg
        };
        assert!(matches!(
            Loader::new(ds, Ids, bad),
            Err(Error::Config { ref key, .. }) if key == "batch_size"
        ));
    }
}
