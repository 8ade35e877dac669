//! A small deterministic random number generator (SplitMix64) so that every shuffle, split and
//! augmentation is a pure function of a seed, identical on every platform and thread count.
//!
//! SplitMix64: Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014;
//! constants as in Vigna's reference `splitmix64.c`.

/// SplitMix64 state.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A generator for a seed derived from several values (seed, epoch, index, …).
    pub fn derived(parts: &[u64]) -> Self {
        Rng(mix(parts))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        finalize(self.0)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`; returns 0 for `n == 0`). Lemire's multiply-shift; the bias is
    /// below 2^-32 for the sizes used here.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fisher–Yates shuffle in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mixes several values into one seed (order matters).
pub fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x6A09_E667_F3BC_C908u64;
    for &p in parts {
        h = finalize(h ^ finalize(p.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_shuffle_is_a_permutation() {
        let a: Vec<u64> = (0..5)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..5)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        let mut v: Vec<usize> = (0..100).collect();
        Rng::new(3).shuffle(&mut v);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        let mut s = v.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
    }

    #[test]
    fn below_and_f64_stay_in_range_and_are_roughly_uniform() {
        let mut r = Rng::new(11);
        let mut counts = [0usize; 4];
        for _ in 0..40_000 {
            let x = r.below(4);
            counts[x] += 1;
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }
}
