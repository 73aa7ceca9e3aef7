//! f32 inner loops of the CPU backend: dot products of dequantized rows with activations. AVX2+FMA when the
//! CPU has it (checked once), plain loops otherwise; both sum in f32 and differ only in summation order.
//!
//! Hot path: no allocation, no locks, no logging.

use std::sync::OnceLock;

fn has_avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(crate::quant::simd_available)
}

/// `Σ a[i] · b[i]` over `a.len()` values (`b` at least as long).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { avx2::dot(a, b) };
    }
    dot_plain(a, b)
}

/// Reference for [`dot`].
pub fn dot_plain(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `acc[i] += a · v[i]`.
#[inline]
pub fn axpy(a: f32, v: &[f32], acc: &mut [f32]) {
    for (o, x) in acc.iter_mut().zip(v) {
        *o += a * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2 and FMA must be available; `b.len() >= a.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        assert!(b.len() >= n);
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        // SAFETY (loads): i + 16 <= n <= len of both slices.
        while i + 16 <= n {
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
            }
            i += 16;
        }
        while i + 8 <= n {
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            }
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_dots_match_the_plain_loop() {
        for n in [1, 7, 8, 15, 16, 33, 64, 577] {
            let a: Vec<f32> = (0..4 * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let x: Vec<f32> = (0..n).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
            let tol = |r: f32| 1e-5 * (1.0 + r.abs() * 10.0);
            let d = dot(&a[..n], &x);
            assert!((d - dot_plain(&a[..n], &x)).abs() <= tol(d), "n={n}");
        }
    }
}
