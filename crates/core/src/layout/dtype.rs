//! Element types, named as safetensors names them (torch's dtypes that safetensors lacks by
//! names of the same style), with their sizes and cast rules.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor: every dtype that torch can save with `torch.save` and
/// `torch.distributed.checkpoint` and that is plain bytes per element (not the quantized
/// types, whose scales live outside the storage, nor the `bits*` raw types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// `bool`, one byte per element.
    #[serde(rename = "BOOL")]
    Bool,
    /// `uint8`.
    U8,
    /// `int8`.
    I8,
    /// `float8_e4m3fn`.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// `float8_e5m2`.
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
    /// `int16`.
    I16,
    /// `uint16`.
    U16,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `int32`.
    I32,
    /// `uint32`.
    U32,
    /// `float32`.
    F32,
    /// `float64`.
    F64,
    /// `int64`.
    I64,
    /// `uint64`.
    U64,
    /// `complex32` (`chalf`): pairs of f16, real part first.
    C32,
    /// `bcomplex32`: pairs of bf16, real part first.
    BC32,
    /// `complex64` (`cfloat`): pairs of f32, real part first.
    C64,
    /// `complex128` (`cdouble`): pairs of f64, real part first.
    C128,
    /// `float8_e4m3fnuz`.
    #[serde(rename = "F8_E4M3FNUZ")]
    F8E4M3FNUZ,
    /// `float8_e5m2fnuz`.
    #[serde(rename = "F8_E5M2FNUZ")]
    F8E5M2FNUZ,
    /// `float8_e8m0fnu`.
    #[serde(rename = "F8_E8M0")]
    F8E8M0,
    /// `float4_e2m1fn_x2`: two fp4 values in each byte, one element per byte.
    #[serde(rename = "F4_E2M1FN_X2")]
    F4E2M1X2,
}

impl DType {
    /// All dtypes: safetensors' classic ones in its order, then the ones added since.
    pub const ALL: [DType; 23] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U64,
        DType::C32,
        DType::C64,
        DType::C128,
        DType::F8E4M3FNUZ,
        DType::F8E5M2FNUZ,
        DType::F8E8M0,
        DType::F4E2M1X2,
        DType::BC32,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool
            | DType::U8
            | DType::I8
            | DType::F8E4M3
            | DType::F8E5M2
            | DType::F8E4M3FNUZ
            | DType::F8E5M2FNUZ
            | DType::F8E8M0
            | DType::F4E2M1X2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 | DType::C32 | DType::BC32 => 4,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// The safetensors name (`"F32"`, `"BF16"`, `"F8_E4M3"`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
            DType::C32 => "C32",
            DType::BC32 => "BC32",
            DType::C64 => "C64",
            DType::C128 => "C128",
            DType::F8E4M3FNUZ => "F8_E4M3FNUZ",
            DType::F8E5M2FNUZ => "F8_E5M2FNUZ",
            DType::F8E8M0 => "F8_E8M0",
            DType::F4E2M1X2 => "F4_E2M1FN_X2",
        }
    }

    /// For a complex dtype, the floating dtype of its real and imaginary parts (a complex
    /// element is two of them, real first, as `torch.view_as_real` shows it).
    pub fn complex_part(self) -> Option<DType> {
        match self {
            DType::C32 => Some(DType::F16),
            DType::BC32 => Some(DType::BF16),
            DType::C64 => Some(DType::F32),
            DType::C128 => Some(DType::F64),
            _ => None,
        }
    }

    /// True for the floating types reshard can cast between (f16, bf16, f32, f64).
    /// fp8 and fp4 tensors are floating too, and complex ones are pairs of floats, but they
    /// move as bytes only.
    pub fn is_castable_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The dtype named `s` when a cast may target it (f16, bf16, f32 or f64, by any name
    /// [`FromStr`] takes): an unknown name, or a dtype no cast targets, is refused with the
    /// accepted names listed.
    pub fn cast_target(s: &str) -> Result<DType, String> {
        match s.parse::<DType>() {
            Ok(d) if d.is_castable_float() => Ok(d),
            Ok(d) => Err(format!(
                "cannot cast to {d}: only floating dtypes (f16, bf16, f32, f64) can be targets"
            )),
            Err(_) => Err(format!(
                "unknown dtype `{s}` (expected f16, bf16, f32 or f64; torch's names float16, \
                 bfloat16, float32, float64 too)"
            )),
        }
    }

    /// True for every real floating type, fp8 and fp4 included (complex types are not).
    pub fn is_float(self) -> bool {
        self.is_castable_float()
            || matches!(
                self,
                DType::F8E4M3
                    | DType::F8E5M2
                    | DType::F8E4M3FNUZ
                    | DType::F8E5M2FNUZ
                    | DType::F8E8M0
                    | DType::F4E2M1X2
            )
    }

    /// Whether values of `self` may be converted to `to`: identity, or between f16/bf16/f32/f64.
    /// Casts between unrelated kinds (float → int, int → float, fp8, fp4, complex) are
    /// refused.
    pub fn can_cast_to(self, to: DType) -> bool {
        self == to || (self.is_castable_float() && to.is_castable_float())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    /// Accepts safetensors names (`F32`, `BF16`) and torch names (`float32`, `bfloat16`, `bf16`).
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        let d = match lower.as_str() {
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "f8_e4m3" | "float8_e4m3fn" | "f8e4m3" => DType::F8E4M3,
            "f8_e5m2" | "float8_e5m2" | "f8e5m2" => DType::F8E5M2,
            "i16" | "int16" | "short" => DType::I16,
            "u16" | "uint16" => DType::U16,
            "f16" | "float16" | "half" | "fp16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i32" | "int32" | "int" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "f32" | "float32" | "float" | "fp32" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i64" | "int64" | "long" => DType::I64,
            "u64" | "uint64" => DType::U64,
            "c32" | "complex32" | "chalf" => DType::C32,
            "c64" | "complex64" | "cfloat" => DType::C64,
            "c128" | "complex128" | "cdouble" => DType::C128,
            "f8_e4m3fnuz" | "float8_e4m3fnuz" => DType::F8E4M3FNUZ,
            "f8_e5m2fnuz" | "float8_e5m2fnuz" => DType::F8E5M2FNUZ,
            "f8_e8m0" | "float8_e8m0fnu" => DType::F8E8M0,
            "f4_e2m1fn_x2" | "float4_e2m1fn_x2" => DType::F4E2M1X2,
            "bc32" | "bcomplex32" => DType::BC32,
            _ => {
                return Err(format!(
                    "unknown dtype `{s}` (expected bool, u8, i8, f8_e4m3, f8_e5m2, i16, u16, \
                     f16, bf16, i32, u32, f32, f64, i64, u64, c32, c64, c128, f8_e4m3fnuz, \
                     f8_e5m2fnuz, f8_e8m0, f4_e2m1fn_x2 or bc32, in either case; torch's names such \
                     as float32, bfloat16 and complex64 too)"
                ))
            }
        };
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
            assert!(matches!(d.size(), 1 | 2 | 4 | 8 | 16));
        }
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert!("complex256".parse::<DType>().is_err());
    }

    #[test]
    fn the_dtypes_beyond_safetensors_classic_ones() {
        // (dtype, reshard name, torch name, bytes per element)
        let table = [
            (DType::C32, "C32", "complex32", 4),
            (DType::C64, "C64", "complex64", 8),
            (DType::C128, "C128", "complex128", 16),
            (DType::F8E4M3FNUZ, "F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
            (DType::F8E5M2FNUZ, "F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
            (DType::F8E8M0, "F8_E8M0", "float8_e8m0fnu", 1),
            (DType::F4E2M1X2, "F4_E2M1FN_X2", "float4_e2m1fn_x2", 1),
            (DType::BC32, "BC32", "bcomplex32", 4),
        ];
        for (d, name, torch, size) in table {
            assert_eq!(d.name(), name);
            assert_eq!(torch.parse::<DType>(), Ok(d));
            assert_eq!(name.to_lowercase().parse::<DType>(), Ok(d));
            assert_eq!(d.size(), size);
            assert!(DType::ALL.contains(&d));
        }
        assert_eq!("cfloat".parse::<DType>(), Ok(DType::C64));
        assert_eq!("cdouble".parse::<DType>(), Ok(DType::C128));
        assert_eq!("chalf".parse::<DType>(), Ok(DType::C32));
        // a complex element is two of its part's, real first
        for d in DType::ALL {
            match d.complex_part() {
                Some(p) => {
                    assert_eq!(d.size(), 2 * p.size());
                    assert!(p.is_castable_float() && !d.is_float());
                }
                None => assert!(!d.name().starts_with('C')),
            }
        }
        assert!(DType::F8E8M0.is_float() && DType::F4E2M1X2.is_float());
    }

    #[test]
    fn refusals_list_the_accepted_names() {
        let e = "fp8".parse::<DType>().unwrap_err();
        assert!(
            e.starts_with("unknown dtype `fp8` (expected bool, u8, "),
            "{e}"
        );
        // every dtype is listed, by a name that is accepted
        let list = e["unknown dtype `fp8` (expected ".len()..e.find(", in either").unwrap()]
            .replace(" or ", ", ");
        let listed: Vec<DType> = list.split(", ").map(|n| n.parse().unwrap()).collect();
        assert_eq!(listed, DType::ALL);
        assert_eq!(DType::cast_target("BFloat16"), Ok(DType::BF16));
        assert_eq!(
            DType::cast_target("fp8"),
            Err(
                "unknown dtype `fp8` (expected f16, bf16, f32 or f64; torch's names float16, \
                 bfloat16, float32, float64 too)"
                    .to_string()
            )
        );
        assert_eq!(
            DType::cast_target("int32"),
            Err(
                "cannot cast to I32: only floating dtypes (f16, bf16, f32, f64) can be targets"
                    .to_string()
            )
        );
    }

    #[test]
    fn cast_rules() {
        assert!(DType::BF16.can_cast_to(DType::F32));
        assert!(DType::F32.can_cast_to(DType::F16));
        assert!(!DType::F32.can_cast_to(DType::I32));
        assert!(!DType::I64.can_cast_to(DType::F64));
        assert!(!DType::F8E4M3.can_cast_to(DType::F32));
        assert!(DType::I64.can_cast_to(DType::I64));
        // complex, fp8 and fp4 (every dtype after safetensors' classic 15) move as bytes:
        // copies only, no cast either way
        for d in DType::ALL[15..].iter().copied() {
            assert!(d.can_cast_to(d));
            for f in [DType::F16, DType::BF16, DType::F32, DType::F64] {
                assert!(!d.can_cast_to(f) && !f.can_cast_to(d), "{d} {f}");
            }
        }
        assert!(!DType::C64.can_cast_to(DType::C128));
        assert_eq!(
            DType::cast_target("complex64"),
            Err(
                "cannot cast to C64: only floating dtypes (f16, bf16, f32, f64) can be targets"
                    .to_string()
            )
        );
    }
}
