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
        // SAFETY: AVX2, FMA and F16C were detected at run time (`quant::simd_available`).
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

/// [`dot`] of an f16 row with `b`, converting as it reads: the same bits as `dot` of the row converted to f32 (the
/// conversion is exact, and the lanes and their order are `dot`'s), without writing the converted row. Decode
/// attention over an f16 KV cache reads each key once a query this way.
#[inline]
pub fn dot_f16(a: &[half::f16], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected at run time (`quant::simd_available`).
        return unsafe { avx2::dot(a, b) };
    }
    a.iter().zip(b).map(|(x, y)| x.to_f32() * y).sum()
}

/// [`axpy`] of an f16 row, converting as it reads: the same bits as `axpy` of the row converted to f32 (a product
/// then a sum, each rounded, as `axpy`'s).
#[inline]
pub fn axpy_f16(a: f32, v: &[half::f16], acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected at run time (`quant::simd_available`).
        return unsafe { avx2::axpy_f16(a, v, acc) };
    }
    for (o, x) in acc.iter_mut().zip(v) {
        *o += a * x.to_f32();
    }
}

/// [`dot_f16`] of the f16 row `a` with each of `out.len()` queries at once: `out[h] = dot_f16(a, q[h * n..][..n])`
/// with `n = a.len()`, the same bits, each value of `a` converted once for all of them (decode attention: a key
/// against a GQA group's query heads). `q` holds at least `out.len() * a.len()` values.
#[inline]
pub fn dots_f16(a: &[half::f16], q: &[f32], out: &mut [f32]) {
    let n = a.len();
    assert!(q.len() >= out.len() * n, "dots_f16: queries");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        for (h0, o) in (0..out.len()).step_by(4).zip(out.chunks_mut(4)) {
            let q = &q[h0 * n..];
            // SAFETY: AVX2, FMA and F16C were detected at run time; `q` holds o.len() rows of n values.
            unsafe {
                match o.len() {
                    1 => avx2::dots::<1>(a, q, o),
                    2 => avx2::dots::<2>(a, q, o),
                    3 => avx2::dots::<3>(a, q, o),
                    _ => avx2::dots::<4>(a, q, o),
                }
            }
        }
        return;
    }
    for (h, o) in out.iter_mut().enumerate() {
        *o = dot_f16(a, &q[h * n..][..n]);
    }
}

/// `acc += w[j] · rows[j]` for each `j` in order with `w[j] != 0` (each `rows[j]` an f16 row of `acc.len()`
/// values): the bits of [`axpy_f16`] row after row, with the sums kept in registers across the rows where `acc`
/// is a multiple of 64 values long (decode attention: a head's weighted sum of the cached values it sees).
#[inline]
pub fn axpy_rows_f16(w: &[f32], rows: &[&[half::f16]], acc: &mut [f32]) {
    assert_eq!(w.len(), rows.len(), "axpy_rows_f16: weights");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && acc.len().is_multiple_of(64) && rows.iter().all(|r| r.len() == acc.len()) {
        for c in (0..acc.len()).step_by(64) {
            // SAFETY: AVX2, FMA and F16C were detected at run time; every row holds acc.len() values, so c..c + 64
            // lies inside each row and inside acc.
            unsafe { avx2::axpy_rows64(w, rows, c, &mut acc[c..c + 64]) }
        }
        return;
    }
    for (&a, v) in w.iter().zip(rows) {
        if a != 0.0 {
            axpy_f16(a, v, acc);
        }
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

    /// A row `dot` reads eight values at a time, as f32.
    pub(super) trait Row {
        fn len(&self) -> usize;
        /// Value `i` as f32.
        fn at(&self, i: usize) -> f32;
        /// Values `i..i + 8` as f32.
        ///
        /// # Safety
        /// AVX2 and F16C must be available; `i + 8 <= len`.
        unsafe fn load8(&self, i: usize) -> __m256;
    }
    impl Row for &[f32] {
        fn len(&self) -> usize {
            <[f32]>::len(self)
        }
        fn at(&self, i: usize) -> f32 {
            self[i]
        }
        #[inline(always)]
        unsafe fn load8(&self, i: usize) -> __m256 {
            // SAFETY: the caller keeps i + 8 <= len.
            unsafe { _mm256_loadu_ps(self.as_ptr().add(i)) }
        }
    }
    impl Row for &[half::f16] {
        fn len(&self) -> usize {
            <[half::f16]>::len(self)
        }
        fn at(&self, i: usize) -> f32 {
            self[i].to_f32()
        }
        #[inline(always)]
        unsafe fn load8(&self, i: usize) -> __m256 {
            // SAFETY: the caller keeps i + 8 <= len and has F16C; an unaligned 16-byte load, converted exactly.
            unsafe { load_f16(self.as_ptr().add(i)) }
        }
    }

    /// Eight f16 values at `p` as f32 (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const half::f16) -> __m256 {
        // SAFETY: the caller keeps p..p + 8 inside its slice; an unaligned 16-byte load.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// `Σ a[i] · b[i]`: two 8-lane accumulators over 16-value steps, one 8-value step, the lanes' sum, then the
    /// scalar tail; the same order for every row type, so an f16 row gives the bits of its f32 conversion.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `b.len() >= a.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<A: Row>(a: A, b: &[f32]) -> f32 {
        let n = a.len();
        assert!(b.len() >= n);
        let pb = b.as_ptr();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        // SAFETY (loads): i + 16 <= n <= len of both rows.
        while i + 16 <= n {
            unsafe {
                acc0 = _mm256_fmadd_ps(a.load8(i), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(a.load8(i + 8), _mm256_loadu_ps(pb.add(i + 8)), acc1);
            }
            i += 16;
        }
        while i + 8 <= n {
            unsafe {
                acc0 = _mm256_fmadd_ps(a.load8(i), _mm256_loadu_ps(pb.add(i)), acc0);
            }
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a.at(i) * b[i];
            i += 1;
        }
        s
    }

    /// `dot` of the f16 row `a` with `M` query rows of `a.len()` values at `q`, into `out[..M]`: each query's lanes
    /// and order are `dot`'s, so each sum has its bits; a loaded step of `a` serves all `M`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `q` holds `M * a.len()` values, `out` `M`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // h indexes both accumulators and the query rows
    pub unsafe fn dots<const M: usize>(a: &[half::f16], q: &[f32], out: &mut [f32]) {
        let n = a.len();
        assert!(q.len() >= M * n && out.len() >= M);
        let (pa, pq) = (a.as_ptr(), q.as_ptr());
        let mut acc0 = [_mm256_setzero_ps(); M];
        let mut acc1 = [_mm256_setzero_ps(); M];
        let mut i = 0;
        // SAFETY (loads): i + 16 <= n, and query h's row is pq + h n .. + n.
        while i + 16 <= n {
            unsafe {
                let (k0, k1) = (load_f16(pa.add(i)), load_f16(pa.add(i + 8)));
                for h in 0..M {
                    let r = pq.add(h * n + i);
                    acc0[h] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(r), acc0[h]);
                    acc1[h] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(r.add(8)), acc1[h]);
                }
            }
            i += 16;
        }
        if i + 8 <= n {
            unsafe {
                let k0 = load_f16(pa.add(i));
                for h in 0..M {
                    acc0[h] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(pq.add(h * n + i)), acc0[h]);
                }
            }
            i += 8;
        }
        for h in 0..M {
            let mut s = hsum(_mm256_add_ps(acc0[h], acc1[h]));
            for j in i..n {
                s += a[j].to_f32() * q[h * n + j];
            }
            out[h] = s;
        }
    }

    /// Columns `c..c + 64` of `axpy_rows_f16`: the 64 sums in eight registers across the rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; every row holds at least `c + 64` values; `acc` 64.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_rows64(w: &[f32], rows: &[&[half::f16]], c: usize, acc: &mut [f32]) {
        assert!(acc.len() >= 64);
        let po = acc.as_mut_ptr();
        // SAFETY: po..po + 64 lies in acc.
        let mut s: [__m256; 8] = std::array::from_fn(|r| unsafe { _mm256_loadu_ps(po.add(8 * r)) });
        for (&a, v) in w.iter().zip(rows) {
            if a != 0.0 {
                assert!(v.len() >= c + 64);
                let (wv, pv) = (_mm256_set1_ps(a), v.as_ptr());
                for (r, s) in s.iter_mut().enumerate() {
                    // SAFETY: c + 8 r + 8 <= c + 64 <= v.len(). A product then a sum, each rounded, as `axpy`.
                    *s = _mm256_add_ps(*s, _mm256_mul_ps(wv, unsafe { load_f16(pv.add(c + 8 * r)) }));
                }
            }
        }
        for (r, s) in s.iter().enumerate() {
            // SAFETY: po + 8 r + 8 <= po + 64.
            unsafe { _mm256_storeu_ps(po.add(8 * r), *s) };
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(a: f32, v: &[half::f16], acc: &mut [f32]) {
        let n = v.len().min(acc.len());
        let (pv, po) = (v.as_ptr(), acc.as_mut_ptr());
        let w = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: i + 8 <= n <= both lengths. A product then a sum, each rounded (no FMA), as `axpy`.
        while i + 8 <= n {
            unsafe {
                let o = _mm256_loadu_ps(po.add(i));
                _mm256_storeu_ps(po.add(i), _mm256_add_ps(o, _mm256_mul_ps(w, load_f16(pv.add(i)))));
            }
            i += 8;
        }
        while i < n {
            acc[i] += a * v[i].to_f32();
            i += 1;
        }
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

    /// The f16 kernels read as they convert, and give the bits of converting first: every length from 0 to 70
    /// (the 16- and 8-wide steps and the scalar tail), values of very different magnitudes, subnormal f16s.
    #[test]
    fn f16_rows_give_the_bits_of_converting_first() {
        for n in 0..=70usize {
            let h: Vec<half::f16> = (0..n)
                .map(|i| half::f16::from_f32(((i * 7919 % 1013) as f32 - 506.0) * [1e-6, 0.01, 3.0, 900.0][i % 4]))
                .collect();
            let f: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
            let q: Vec<f32> = (0..n).map(|i| ((i * 131 % 97) as f32 - 48.0) / 13.0).collect();
            assert_eq!(dot_f16(&h, &q).to_bits(), dot(&f, &q).to_bits(), "dot, n={n}");
            let mut a = q.clone();
            let mut b = q.clone();
            axpy_f16(0.37, &h, &mut a);
            axpy(0.37, &f, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "axpy, n={n}");
        }
    }

    /// A head's weighted sum of value rows, its sums in registers, gives the bits of adding one row at a time:
    /// widths of 64, 128 and 256 (the register path) and others (the row-by-row path), weights of 0 skipped.
    #[test]
    fn value_rows_give_the_bits_of_one_row_at_a_time() {
        for n in [0usize, 5, 64, 72, 128, 256] {
            let rows: Vec<Vec<half::f16>> = (0..37)
                .map(|j| {
                    (0..n)
                        .map(|i| half::f16::from_f32(((i * 7919 + j * 31) % 1013) as f32 / 97.0 - 5.0))
                        .collect()
                })
                .collect();
            let refs: Vec<&[half::f16]> = rows.iter().map(|r| &r[..]).collect();
            let w: Vec<f32> = (0..37)
                .map(|j| if j % 5 == 2 { 0.0 } else { 1.0 / (1.0 + j as f32) })
                .collect();
            let start: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.01).collect();
            let mut got = start.clone();
            axpy_rows_f16(&w, &refs, &mut got);
            let mut want = start;
            for (&a, r) in w.iter().zip(&refs) {
                if a != 0.0 {
                    axpy_f16(a, r, &mut want);
                }
            }
            assert!(got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()), "n={n}");
        }
    }

    /// A key against several query heads at once gives each head the bits of the one-head kernel: every length
    /// from 0 to 70, 1 to 9 heads (chunks of four and the remainders).
    #[test]
    fn several_heads_give_the_bits_of_one_at_a_time() {
        for n in 0..=70usize {
            let h: Vec<half::f16> = (0..n)
                .map(|i| half::f16::from_f32(((i * 7919 % 1013) as f32 - 506.0) * [1e-6, 0.01, 3.0, 900.0][i % 4]))
                .collect();
            for heads in 1..=9usize {
                let q: Vec<f32> = (0..heads * n).map(|i| ((i * 131 % 97) as f32 - 48.0) / 13.0).collect();
                let mut got = vec![f32::NAN; heads];
                dots_f16(&h, &q, &mut got);
                for (k, g) in got.iter().enumerate() {
                    let want = dot_f16(&h, &q[k * n..][..n]);
                    assert_eq!(g.to_bits(), want.to_bits(), "dots, n={n} heads={heads} head {k}");
                }
            }
        }
    }
}
