//! Cast kernels: the element conversions between the floating dtypes that a plan's
//! [`crate::plan::Cast`] asks for, run by the executor on bytes in memory.
//!
//! One loop per dtype pair, chosen once per call. Every conversion rounds once, to nearest
//! even, as torch does; NaN payloads are kept bit for bit.

use super::DType;
use half::{bf16, f16};

/// Convert the elements of `src` bytes (dtype `from`) into `dst` bytes (dtype `to`), both
/// little-endian; `dst` holds as many elements as `src`.
///
/// bf16 → f32 is a 16-bit shift and the others go through `half`'s scalar conversions, each
/// a single round-to-nearest-even from f32 (f64 sources round once from f64), with no
/// per-element match (`cargo bench --bench casts` measures them).
/// The same dtype, or a pair the planner never emits (it checks casts when it plans),
/// copies the bytes.
pub fn convert(from: DType, to: DType, src: &[u8], dst: &mut [u8]) {
    fn each<const S: usize, const D: usize>(
        src: &[u8],
        dst: &mut [u8],
        f: impl Fn([u8; S]) -> [u8; D],
    ) {
        for (s, d) in src.chunks_exact(S).zip(dst.chunks_exact_mut(D)) {
            let mut a = [0u8; S];
            a.copy_from_slice(s);
            d.copy_from_slice(&f(a));
        }
    }
    let f32_of = |b: [u8; 4]| f32::from_le_bytes(b);
    let f64_of = |b: [u8; 8]| f64::from_le_bytes(b);
    let bf16_to_f32 = |b: [u8; 2]| f32::from_bits((u16::from_le_bytes(b) as u32) << 16);
    // NaN payloads are kept bit for bit (`half` sets the quiet bit; torch's c10 does not).
    let f16_to_f32 = |b: [u8; 2]| {
        let h = u16::from_le_bytes(b);
        if h & 0x7c00 == 0x7c00 && h & 0x03ff != 0 {
            f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7f80_0000 | ((h as u32 & 0x03ff) << 13))
        } else {
            f16::from_bits(h).to_f32()
        }
    };
    match (from, to) {
        (DType::BF16, DType::F32) => each(src, dst, |b| bf16_to_f32(b).to_le_bytes()),
        (DType::F16, DType::F32) => each(src, dst, |b| f16_to_f32(b).to_le_bytes()),
        (DType::BF16, DType::F64) => each(src, dst, |b| (bf16_to_f32(b) as f64).to_le_bytes()),
        (DType::F16, DType::F64) => each(src, dst, |b| (f16_to_f32(b) as f64).to_le_bytes()),
        (DType::F32, DType::F64) => each(src, dst, |b| (f32_of(b) as f64).to_le_bytes()),
        (DType::F32, DType::BF16) => each(src, dst, |b| {
            bf16::from_f32(f32_of(b)).to_bits().to_le_bytes()
        }),
        (DType::F32, DType::F16) => each(src, dst, |b| {
            f16::from_f32(f32_of(b)).to_bits().to_le_bytes()
        }),
        // bf16 and f16 are exact in f32, so one rounding
        (DType::F16, DType::BF16) => each(src, dst, |b| {
            bf16::from_f32(f16_to_f32(b)).to_bits().to_le_bytes()
        }),
        (DType::BF16, DType::F16) => each(src, dst, |b| {
            f16::from_f32(bf16_to_f32(b)).to_bits().to_le_bytes()
        }),
        (DType::F64, DType::F32) => each(src, dst, |b| (f64_of(b) as f32).to_le_bytes()),
        (DType::F64, DType::BF16) => each(src, dst, |b| {
            bf16::from_f64(f64_of(b)).to_bits().to_le_bytes()
        }),
        (DType::F64, DType::F16) => each(src, dst, |b| {
            f16::from_f64(f64_of(b)).to_bits().to_le_bytes()
        }),
        // same dtype, or pairs the planner never emits (checked when the plan is made)
        _ => {
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
        }
    }
}

/// The f32 bits of a `float8_e4m3fn` byte (sign, 4 exponent bits of bias 7, 3 mantissa
/// bits; no infinities, `S.1111.111` is NaN): exact, as torch widens it.
const fn e4m3_bits(b: u8) -> u32 {
    let s = ((b as u32) & 0x80) << 24;
    let e = ((b >> 3) & 0xf) as u32;
    let m = (b & 7) as u32;
    if e == 15 && m == 7 {
        return s | 0x7fc0_0000;
    }
    if e == 0 {
        if m == 0 {
            return s;
        }
        // subnormal: m · 2^-9, normalised
        let k = 31 - m.leading_zeros();
        return s | ((127 + k - 9) << 23) | ((m - (1 << k)) << (23 - k));
    }
    s | ((e + 120) << 23) | (m << 20)
}

/// [`e4m3_bits`] of every byte.
const E4M3: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_bits(i as u8);
        i += 1;
    }
    t
};

/// The f32 value of a `float8_e4m3fn` byte (exact).
pub fn e4m3_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3[b as usize])
}

/// Where a block-quantized tensor's scales are, for [`dequantize`]: `block` rows × columns
/// per scale, `cols` elements per row of the quantized tensor, and `scales` the scale
/// tensor's f32 rows (`⌈cols/block[1]⌉` scales each, little-endian) from block row `row0` on.
#[derive(Clone, Copy, Debug)]
pub struct Scales<'a> {
    /// The scale rows.
    pub scales: &'a [u8],
    /// Block row of `scales`' first row.
    pub row0: u64,
    /// Elements per row of the quantized tensor.
    pub cols: u64,
    /// Rows and columns of a block.
    pub block: [u64; 2],
}

/// Dequantize `src` (`F8_E4M3` bytes whose first is element `first` of a row-major tensor of
/// `s.cols` columns) into `dst` (elements of `to`, f16, bf16, f32 or f64): each element
/// widened to f32 and multiplied by its block's scale in f32, then rounded once to `to`
/// (to nearest even) — DeepSeek-V3's `weight_dequant`. Another `from` copies the bytes.
pub fn dequantize(from: DType, to: DType, src: &[u8], first: u64, s: &Scales, dst: &mut [u8]) {
    if from != DType::F8E4M3 || s.cols == 0 || s.block[0] == 0 || s.block[1] == 0 {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        return;
    }
    let [bm, bn] = s.block;
    let bc = s.cols.div_ceil(bn);
    let size = to.size();
    let mut i = 0usize;
    while i < src.len() {
        let e = first + i as u64;
        let (r, c) = (e / s.cols, e % s.cols);
        let run = ((src.len() - i) as u64).min(bn - c % bn).min(s.cols - c) as usize;
        let at = ((r / bm - s.row0) * bc + c / bn) as usize * 4;
        let scale = f32::from_le_bytes(s.scales[at..at + 4].try_into().expect("4 bytes"));
        let xs = src[i..i + run].iter().map(|&b| e4m3_to_f32(b) * scale);
        let out = &mut dst[i * size..(i + run) * size];
        match to {
            DType::BF16 => out
                .chunks_exact_mut(2)
                .zip(xs)
                .for_each(|(d, y)| d.copy_from_slice(&bf16::from_f32(y).to_bits().to_le_bytes())),
            DType::F16 => out
                .chunks_exact_mut(2)
                .zip(xs)
                .for_each(|(d, y)| d.copy_from_slice(&f16::from_f32(y).to_bits().to_le_bytes())),
            DType::F32 => out
                .chunks_exact_mut(4)
                .zip(xs)
                .for_each(|(d, y)| d.copy_from_slice(&y.to_le_bytes())),
            DType::F64 => out
                .chunks_exact_mut(8)
                .zip(xs)
                .for_each(|(d, y)| d.copy_from_slice(&(y as f64).to_le_bytes())),
            // the planner dequantizes only into floating dtypes
            _ => {}
        }
        i += run;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_bytes_widen_exactly() {
        for b in 0..=255u8 {
            let (sign, e, m) = (b >> 7, (b >> 3) & 0xf, b & 7);
            let x = e4m3_to_f32(b);
            if e == 15 && m == 7 {
                assert!(x.is_nan());
                continue;
            }
            let mag = if e == 0 {
                m as f64 / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
            };
            let want = if sign == 1 { -mag } else { mag };
            assert_eq!(x as f64, want, "{b:#04x}");
            assert_eq!(x.is_sign_negative(), sign == 1, "{b:#04x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
    }

    #[test]
    fn dequantize_uses_each_elements_block_across_cuts() {
        // a 3×5 tensor in blocks of 2×2: scale grid 2×3, partial edge blocks
        let scales: Vec<f32> = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let sb: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src: Vec<u8> = vec![0x38; 15]; // 1.0 each
        let s = Scales {
            scales: &sb,
            row0: 0,
            cols: 5,
            block: [2, 2],
        };
        let mut whole = vec![0u8; 15 * 4];
        dequantize(DType::F8E4M3, DType::F32, &src, 0, &s, &mut whole);
        let got: Vec<f32> = whole
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want = [
            1., 1., 2., 2., 4., 1., 1., 2., 2., 4., 8., 8., 16., 16., 32.,
        ];
        assert_eq!(got, want);
        // elements 7.. read from block row 0 on, and from row 1 on with only that row
        let mut part = vec![0u8; 8 * 4];
        dequantize(DType::F8E4M3, DType::F32, &src[7..], 7, &s, &mut part);
        assert_eq!(part, whole[7 * 4..]);
        let tail = Scales {
            scales: &sb[12..],
            row0: 1,
            ..s
        };
        let mut part = vec![0u8; 5 * 4];
        dequantize(DType::F8E4M3, DType::F32, &src[10..], 10, &tail, &mut part);
        assert_eq!(part, whole[10 * 4..]);
    }

    #[test]
    fn casts_agree_with_half_for_every_16_bit_pattern() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let mut out = vec![0u8; 65536 * 4];
        // 16-bit -> f32 is exact; NaN payloads are kept as torch's c10 conversions keep them
        // (`half` would set the quiet bit).
        let nan16 = |b: u16| b & 0x7c00 == 0x7c00 && b & 0x03ff != 0;
        convert(DType::BF16, DType::F32, &all, &mut out);
        for (b, o) in (0..=u16::MAX).zip(out.chunks_exact(4)) {
            let got = u32::from_le_bytes(o.try_into().unwrap());
            assert_eq!(got, (b as u32) << 16, "bf16 {b:#06x}");
            let x = bf16::from_bits(b);
            if !x.is_nan() {
                assert_eq!(got, x.to_f32().to_bits(), "bf16 {b:#06x}");
            }
        }
        convert(DType::F16, DType::F32, &all, &mut out);
        for (b, o) in (0..=u16::MAX).zip(out.chunks_exact(4)) {
            let got = u32::from_le_bytes(o.try_into().unwrap());
            let want = if nan16(b) {
                ((b as u32 & 0x8000) << 16) | 0x7f80_0000 | ((b as u32 & 0x03ff) << 13)
            } else {
                f16::from_bits(b).to_f32().to_bits()
            };
            assert_eq!(got, want, "f16 {b:#06x}");
        }
        // f32 -> 16-bit: round to nearest even, as half (and torch) do, specials included
        let mut vals: Vec<u32> = (0..200_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        vals.extend([
            0,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0x3f80_8000,
            0x3f81_8000,
        ]);
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut half_out = vec![0u8; vals.len() * 2];
        convert(DType::F32, DType::BF16, &src, &mut half_out);
        for (v, o) in vals.iter().zip(half_out.chunks_exact(2)) {
            let want = bf16::from_f32(f32::from_bits(*v)).to_bits();
            assert_eq!(
                u16::from_le_bytes([o[0], o[1]]),
                want,
                "f32 {v:#010x} -> bf16"
            );
        }
        convert(DType::F32, DType::F16, &src, &mut half_out);
        for (v, o) in vals.iter().zip(half_out.chunks_exact(2)) {
            let want = f16::from_f32(f32::from_bits(*v)).to_bits();
            assert_eq!(
                u16::from_le_bytes([o[0], o[1]]),
                want,
                "f32 {v:#010x} -> f16"
            );
        }
    }

    #[test]
    fn casts_round_trip_exactly_representable_values() {
        let vals = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut mid = vec![0u8; vals.len() * 2];
        convert(DType::F32, DType::BF16, &src, &mut mid);
        let mut back = vec![0u8; vals.len() * 4];
        convert(DType::BF16, DType::F32, &mid, &mut back);
        let got: Vec<f32> = back
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (g, v) in got.iter().zip(vals) {
            assert_eq!(*g, bf16::from_f32(v).to_f32());
        }
        assert_eq!(got[1], 1.5);
        let mut h = vec![0u8; vals.len() * 2];
        convert(DType::F32, DType::F16, &src, &mut h);
        assert_eq!(
            f16::from_bits(u16::from_le_bytes([h[6], h[7]])).to_f32(),
            65504.0
        );
    }
}
