//! The one table of torch dtypes: canonical names (`str(dtype)` without `torch.`), their
//! aliases, the reshard [`DType`] each maps to (when reshard supports it), the legacy typed
//! storage class `torch.<X>Storage` that encodes it, and whether torch 2.1's weights-only
//! unpickler accepts it as a global. The pickle allow-lists, the tensor rebuild reader and
//! writer, and the DCP metadata writer all derive what they need from [`TABLE`].

use crate::layout::DType;

/// One torch dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchDType {
    /// Canonical name: `float32`, `float8_e4m3fn`, …
    pub name: &'static str,
    /// Other names torch defines for it (`float`, `half`, `long`, …).
    pub aliases: &'static [&'static str],
    /// The reshard dtype, `None` for dtypes reshard does not read or write.
    pub dtype: Option<DType>,
    /// The legacy typed storage class (`FloatStorage`), if the dtype has one. Dtypes without
    /// one (uint16/32/64, float8, float4, complex32) are written with `_rebuild_tensor_v3`,
    /// which torch ≥ 2.3 reads.
    pub storage: Option<&'static str>,
    /// Whether torch 2.1's weights-only unpickler accepts `torch.<name>` as a global.
    pub torch21: bool,
}

const fn t(
    name: &'static str,
    aliases: &'static [&'static str],
    dtype: Option<DType>,
    storage: Option<&'static str>,
    torch21: bool,
) -> TorchDType {
    TorchDType {
        name,
        aliases,
        dtype,
        storage,
        torch21,
    }
}

/// Only the name: a dtype reshard neither reads nor writes, without a storage class.
const fn other(name: &'static str) -> TorchDType {
    t(name, &[], None, None, false)
}

/// Every torch dtype that a pickle may reference as a bare global (torch 2.1 … 2.15).
pub const TABLE: &[TorchDType] = &[
    t(
        "float32",
        &["float"],
        Some(DType::F32),
        Some("FloatStorage"),
        true,
    ),
    t(
        "float64",
        &["double"],
        Some(DType::F64),
        Some("DoubleStorage"),
        true,
    ),
    t(
        "float16",
        &["half"],
        Some(DType::F16),
        Some("HalfStorage"),
        true,
    ),
    t(
        "bfloat16",
        &[],
        Some(DType::BF16),
        Some("BFloat16Storage"),
        false,
    ),
    t("complex32", &["chalf"], Some(DType::C32), None, true),
    t("bcomplex32", &[], Some(DType::BC32), None, false),
    t(
        "complex64",
        &["cfloat"],
        Some(DType::C64),
        Some("ComplexFloatStorage"),
        true,
    ),
    t(
        "complex128",
        &["cdouble"],
        Some(DType::C128),
        Some("ComplexDoubleStorage"),
        true,
    ),
    t("uint8", &[], Some(DType::U8), Some("ByteStorage"), false),
    t("uint16", &[], Some(DType::U16), None, false),
    t("uint32", &[], Some(DType::U32), None, false),
    t("uint64", &[], Some(DType::U64), None, false),
    t("int8", &[], Some(DType::I8), Some("CharStorage"), true),
    t(
        "int16",
        &["short"],
        Some(DType::I16),
        Some("ShortStorage"),
        true,
    ),
    t(
        "int32",
        &["int"],
        Some(DType::I32),
        Some("IntStorage"),
        true,
    ),
    t(
        "int64",
        &["long"],
        Some(DType::I64),
        Some("LongStorage"),
        true,
    ),
    t("bool", &[], Some(DType::Bool), Some("BoolStorage"), false),
    t("qint8", &[], None, Some("QInt8Storage"), false),
    t("quint8", &[], None, Some("QUInt8Storage"), false),
    t("qint32", &[], None, Some("QInt32Storage"), false),
    t("quint4x2", &[], None, Some("QUInt4x2Storage"), false),
    t("quint2x4", &[], None, Some("QUInt2x4Storage"), false),
    t("float8_e4m3fn", &[], Some(DType::F8E4M3), None, false),
    t("float8_e4m3fnuz", &[], Some(DType::F8E4M3FNUZ), None, false),
    t("float8_e5m2", &[], Some(DType::F8E5M2), None, false),
    t("float8_e5m2fnuz", &[], Some(DType::F8E5M2FNUZ), None, false),
    t("float8_e8m0fnu", &[], Some(DType::F8E8M0), None, false),
    t("float4_e2m1fn_x2", &[], Some(DType::F4E2M1X2), None, false),
    other("bits1x8"),
    other("bits2x4"),
    other("bits4x2"),
    other("bits8"),
    other("bits16"),
    other("int1"),
    other("int2"),
    other("int3"),
    other("int4"),
    other("int5"),
    other("int6"),
    other("int7"),
    other("uint1"),
    other("uint2"),
    other("uint3"),
    other("uint4"),
    other("uint5"),
    other("uint6"),
    other("uint7"),
];

/// The entry of a reshard dtype (every [`DType`] has one).
pub fn of(d: DType) -> &'static TorchDType {
    TABLE
        .iter()
        .find(|t| t.dtype == Some(d))
        .expect("every DType is in the torch dtype table (tested)")
}

/// The torch name of a dtype (`float32`, `float8_e4m3fn`, …).
pub fn torch_dtype_name(d: DType) -> &'static str {
    of(d).name
}

/// The legacy typed storage class `torch.<X>Storage` of a dtype, if it has one. Dtypes without
/// one (uint16/32/64, float8, float4, complex32) are written with `_rebuild_tensor_v3`, which
/// torch ≥ 2.3 reads.
pub fn legacy_storage(d: DType) -> Option<&'static str> {
    of(d).storage
}

/// The entry named `name`, canonically or by an alias.
pub fn by_name(name: &str) -> Option<&'static TorchDType> {
    TABLE
        .iter()
        .find(|t| t.name == name || t.aliases.contains(&name))
}

/// The entry whose legacy storage class is `class` (`FloatStorage`).
pub fn by_storage(class: &str) -> Option<&'static TorchDType> {
    TABLE.iter().find(|t| t.storage == Some(class))
}

/// The entry whose canonical name is `name` (aliases excluded).
pub fn canonical(name: &str) -> Option<&'static TorchDType> {
    TABLE.iter().find(|t| t.name == name)
}

/// Every name a pickle may use for a dtype global: canonical names and aliases.
pub fn global_names() -> impl Iterator<Item = &'static str> {
    TABLE
        .iter()
        .flat_map(|t| std::iter::once(t.name).chain(t.aliases.iter().copied()))
}

/// Every legacy typed storage class name.
pub fn storage_classes() -> impl Iterator<Item = &'static str> {
    TABLE.iter().filter_map(|t| t.storage)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_one_entry_whose_name_parses_back() {
        for d in DType::ALL {
            assert_eq!(TABLE.iter().filter(|t| t.dtype == Some(d)).count(), 1);
            let name = torch_dtype_name(d);
            assert_eq!(name.parse::<DType>().unwrap(), d);
            assert_eq!(by_name(name).and_then(|t| t.dtype), Some(d));
        }
        for t in TABLE {
            for a in t.aliases {
                assert_eq!(by_name(a), Some(t));
            }
        }
        // Reading a dtype global through the table gives what `DType::from_str` gave.
        for n in global_names() {
            assert_eq!(
                by_name(n).and_then(|t| t.dtype),
                n.parse::<DType>().ok(),
                "{n}"
            );
        }
        assert_eq!(global_names().count(), 56);
        assert_eq!(storage_classes().count(), 17);
        assert_eq!(
            by_storage("ComplexFloatStorage").unwrap().dtype,
            Some(DType::C64)
        );
        assert_eq!(
            by_storage("ComplexDoubleStorage").unwrap().dtype,
            Some(DType::C128)
        );
        assert_eq!(by_storage("QInt8Storage").unwrap().dtype, None);
        assert_eq!(by_name("bits8").unwrap().dtype, None);
    }
}
