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

#[cfg(test)]
mod tests {
    use super::*;

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
