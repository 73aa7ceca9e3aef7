//! One test per GGUF reading error: write a valid file, corrupt one field precisely, and check the variant and
//! that the message names the file, the key or tensor, and the byte offset of the field.

use strata_engine::gguf::{
    GgufError, GgufFile, GgufHeader, MAX_ARRAY_DEPTH, Metadata, TensorSpec, Value, ValueType, to_bytes,
};
use strata_engine::quant::types::GgmlType;

const NAME: &str = "corrupt-test.gguf";

fn metadata() -> Metadata {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    md.insert("general.alignment", Value::U32(32));
    md.insert("t.u8", Value::U8(7));
    md.insert("t.i8", Value::I8(-7));
    md.insert("t.u64", Value::U64(1 << 40));
    md.insert("t.string", Value::String("hello".into()));
    md.insert(
        "t.arr_i32",
        Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(2)]),
    );
    md
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("aa.weight", &[64, 2], GgmlType::Q8_0),
        TensorSpec::new("bb.weight", &[4, 2], GgmlType::F32),
        TensorSpec::new("cc.weight", &[8], GgmlType::F16),
    ]
}

/// A valid file: the metadata above and three tensors filled with a byte pattern.
fn valid() -> Vec<u8> {
    let data: Vec<(TensorSpec, Vec<u8>)> = specs()
        .into_iter()
        .map(|s| {
            let rows: u64 = s.dims[1..].iter().product();
            let n = s.ty.row_bytes(s.dims[0]).unwrap() * rows;
            (s, (0..n).map(|i| i as u8 ^ 0x5a).collect())
        })
        .collect();
    let borrowed: Vec<(TensorSpec, &[u8])> = data.iter().map(|(s, d)| (s.clone(), d.as_slice())).collect();
    let bytes = to_bytes(NAME, &metadata(), &borrowed).unwrap();
    GgufFile::from_bytes(NAME, bytes.clone()).expect("the uncorrupted file parses");
    bytes
}

/// Offset of the first occurrence of `needle` as a GGUF string (preceded by its u64 length): the offset of the
/// string's first byte.
fn find_str(bytes: &[u8], needle: &str) -> usize {
    let mut pat = (needle.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(needle.as_bytes());
    bytes
        .windows(pat.len())
        .position(|w| w == pat)
        .unwrap_or_else(|| panic!("`{needle}` not in file"))
        + 8
}

/// Offset of a metadata value (just after its u32 type tag).
fn value_at(bytes: &[u8], key: &str) -> usize {
    find_str(bytes, key) + key.len() + 4
}

/// Offset of a tensor info's `n_dims` field.
fn n_dims_at(bytes: &[u8], tensor: &str) -> usize {
    find_str(bytes, tensor) + tensor.len()
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Parses `bytes`, expecting an error whose message holds the file name and every one of `needles`.
fn parse_err(bytes: Vec<u8>, needles: &[&str]) -> GgufError {
    let header_err = GgufHeader::parse(NAME, &bytes).expect_err("the corrupted file must not parse");
    let err = GgufFile::from_bytes(NAME, bytes).expect_err("the corrupted file must not parse");
    let msg = err.to_string();
    assert_eq!(header_err.to_string(), msg, "both parse paths give the same error");
    assert!(msg.contains(NAME), "message does not name the file: {msg}");
    for needle in needles {
        assert!(msg.contains(needle), "message lacks {needle:?}: {msg}");
    }
    err
}

fn offset(at: usize) -> String {
    format!("offset {at}")
}

#[test]
fn bad_magic() {
    let mut b = valid();
    b[..4].copy_from_slice(b"GGML");
    let err = parse_err(b, &[&offset(0), "GGUF"]);
    assert!(matches!(err, GgufError::BadMagic { found, .. } if &found == b"GGML"));
}

#[test]
fn unsupported_version() {
    for (version, hint) in [
        (1u32, "obsolete"),
        (4, "versions 2 and 3"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut b = valid();
        put_u32(&mut b, 4, version);
        let err = parse_err(b, &[&offset(4), hint, &version.to_string()]);
        assert!(matches!(err, GgufError::UnsupportedVersion { version: v, offset: 4, .. } if v == version));
    }
    // Version 2 has the same layout and is read.
    let mut b = valid();
    put_u32(&mut b, 4, 2);
    assert_eq!(GgufFile::from_bytes(NAME, b).unwrap().version(), 2);
}

#[test]
fn truncated() {
    let b = valid();
    let at = data_offset_field(&b, "cc.weight", 1);
    let err = parse_err(b[..at + 5].to_vec(), &["`cc.weight`", &offset(at), "needed 8 bytes"]);
    assert!(matches!(err, GgufError::Truncated { needed: 8, file_bytes, .. } if file_bytes == at as u64 + 5));
    // Early in the metadata, the counts alone show the file is too short.
    let at = value_at(&b, "t.u64");
    let err = parse_err(b[..at + 5].to_vec(), &["metadata entry count", &offset(16)]);
    assert!(matches!(err, GgufError::CountTooLarge { .. }));
    // Too short to hold the counts.
    let err = parse_err(b[..10].to_vec(), &["tensor count", &offset(8)]);
    assert!(matches!(err, GgufError::Truncated { .. }));
    let err = parse_err(Vec::new(), &["magic", &offset(0)]);
    assert!(matches!(err, GgufError::Truncated { .. }));
}

#[test]
fn string_length_past_end() {
    let mut b = valid();
    let at = value_at(&b, "t.string");
    put_u64(&mut b, at, 1 << 40);
    let err = parse_err(b, &["`t.string`", &offset(at), "string", &(1u64 << 40).to_string()]);
    assert!(matches!(err, GgufError::LengthPastEnd { kind: "string", .. }));
}

#[test]
fn array_length_past_end() {
    let mut b = valid();
    let count_at = value_at(&b, "t.arr_i32") + 4;
    put_u64(&mut b, count_at, u64::MAX / 2);
    let err = parse_err(b, &["`t.arr_i32`", &offset(count_at), "array"]);
    assert!(matches!(err, GgufError::LengthPastEnd { kind: "array", .. }));
}

#[test]
fn absurd_counts_fail_fast() {
    let mut b = valid();
    put_u64(&mut b, 8, u64::MAX);
    let err = parse_err(b, &["tensor count", &offset(8), &u64::MAX.to_string()]);
    assert!(matches!(err, GgufError::CountTooLarge { .. }));
    let mut b = valid();
    put_u64(&mut b, 16, 1 << 50);
    let err = parse_err(b, &["metadata entry count", &offset(16)]);
    assert!(matches!(err, GgufError::CountTooLarge { count, .. } if count == 1 << 50));
}

#[test]
fn invalid_utf8_in_key_and_string() {
    let mut b = valid();
    let at = find_str(&b, "t.i8");
    b[at + 2] = 0xff;
    let err = parse_err(b, &["key of metadata entry #3", &offset(at - 8), "UTF-8"]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }));

    let mut b = valid();
    let at = value_at(&b, "t.string");
    b[at + 8] = 0xc3; // a lead byte with no continuation
    let err = parse_err(b, &["`t.string`", &offset(at)]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }));

    let mut b = valid();
    let at = find_str(&b, "bb.weight");
    b[at] = 0x80;
    let err = parse_err(b, &["name of tensor info #1", &offset(at - 8)]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }));
}

#[test]
fn unknown_value_type() {
    let mut b = valid();
    let at = value_at(&b, "t.u8") - 4;
    put_u32(&mut b, at, 13);
    let err = parse_err(b, &["`t.u8`", &offset(at), "13"]);
    assert!(matches!(err, GgufError::UnknownValueType { type_id: 13, .. }));
    // Inside an array: the element type.
    let mut b = valid();
    let at = value_at(&b, "t.arr_i32");
    put_u32(&mut b, at, 99);
    let err = parse_err(b, &["`t.arr_i32`", &offset(at), "99"]);
    assert!(matches!(err, GgufError::UnknownValueType { type_id: 99, .. }));
}

/// A header with no tensors and one metadata key `deep` holding `levels` nested arrays around an empty u8 array.
fn nested(levels: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(b"deep");
    b.extend_from_slice(&(ValueType::Array as u32).to_le_bytes());
    for _ in 1..levels {
        b.extend_from_slice(&(ValueType::Array as u32).to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
    }
    b.extend_from_slice(&(ValueType::U8 as u32).to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b
}

#[test]
fn nesting_too_deep() {
    let ok = GgufFile::from_bytes(NAME, nested(MAX_ARRAY_DEPTH)).unwrap();
    assert!(ok.metadata().get_array("deep").is_ok());
    // The array that is one level too deep starts after the header (24), key (8 + 4), tag (4) and the
    // MAX_ARRAY_DEPTH arrays (12 bytes each) around it.
    let at = 24 + 12 + 4 + 12 * MAX_ARRAY_DEPTH;
    let err = parse_err(
        nested(MAX_ARRAY_DEPTH + 1),
        &["`deep`", &offset(at), &MAX_ARRAY_DEPTH.to_string()],
    );
    assert!(matches!(err, GgufError::NestingTooDeep { .. }));
    // Very deep input stays an error, not a stack overflow.
    let err = parse_err(nested(100_000), &["`deep`"]);
    assert!(matches!(err, GgufError::NestingTooDeep { .. }));
}

#[test]
fn duplicate_key() {
    let mut b = valid();
    let at = find_str(&b, "t.i8");
    b[at..at + 4].copy_from_slice(b"t.u8");
    let err = parse_err(b, &["`t.u8`", &offset(at - 8), "twice"]);
    assert!(matches!(err, GgufError::DuplicateKey { .. }));
}

#[test]
fn bad_alignment() {
    let mut b = valid();
    let at = value_at(&b, "general.alignment");
    put_u32(&mut b, at, 48);
    let err = parse_err(b, &["`general.alignment`", &offset(at), "48", "power of two"]);
    assert!(matches!(err, GgufError::BadAlignment { .. }));
    let mut b = valid();
    put_u32(&mut b, at, 0);
    assert!(matches!(parse_err(b, &[&offset(at)]), GgufError::BadAlignment { .. }));
    // A float where an integer belongs.
    let mut b = valid();
    put_u32(&mut b, at - 4, ValueType::F32 as u32);
    let err = parse_err(b, &["`general.alignment`", &offset(at), "F32"]);
    assert!(matches!(err, GgufError::BadAlignment { .. }));
}

#[test]
fn too_many_dims() {
    let mut b = valid();
    let at = n_dims_at(&b, "bb.weight");
    put_u32(&mut b, at, 5);
    let err = parse_err(b, &["`bb.weight`", &offset(at), "5 dimensions"]);
    assert!(matches!(err, GgufError::TooManyDims { n_dims: 5, .. }));
}

#[test]
fn negative_dim() {
    let mut b = valid();
    let at = n_dims_at(&b, "bb.weight") + 4 + 8;
    put_u64(&mut b, at, (-3i64) as u64);
    let err = parse_err(b, &["`bb.weight`", &offset(at), "dimension 1"]);
    assert!(matches!(err, GgufError::DimOutOfRange { index: 1, .. }));
}

#[test]
fn dims_overflow() {
    let mut b = valid();
    let at = n_dims_at(&b, "bb.weight");
    put_u64(&mut b, at + 4, 1 << 32);
    put_u64(&mut b, at + 12, 1 << 32);
    let err = parse_err(b, &["`bb.weight`", &offset(at), "element count"]);
    assert!(matches!(err, GgufError::DimsOverflow { .. }));
    // 2^62 F32 elements fit an i64 count, but not a u64 byte size.
    let mut b = valid();
    put_u64(&mut b, at + 4, 1 << 31);
    put_u64(&mut b, at + 12, 1 << 31);
    let err = parse_err(b, &["`bb.weight`", &offset(at), "byte size"]);
    assert!(matches!(err, GgufError::DimsOverflow { .. }));
}

#[test]
fn zero_dim_is_an_empty_tensor() {
    let mut b = valid();
    let at = n_dims_at(&b, "bb.weight");
    put_u64(&mut b, at + 12, 0);
    let f = GgufFile::from_bytes(NAME, b).unwrap();
    let t = f.tensor("bb.weight").unwrap();
    assert_eq!((t.n_elements(), t.n_bytes, f.tensor_data(t).len()), (0, 0, 0));
}

#[test]
fn unknown_tensor_type() {
    let mut b = valid();
    let at = n_dims_at(&b, "cc.weight") + 4 + 8;
    put_u32(&mut b, at, 4); // retired Q4_2
    let err = parse_err(b, &["`cc.weight`", &offset(at), "type id 4"]);
    assert!(matches!(err, GgufError::UnknownTensorType { type_id: 4, .. }));
}

#[test]
fn partial_block() {
    let mut b = valid();
    let at = n_dims_at(&b, "aa.weight");
    put_u64(&mut b, at + 4, 48);
    let err = parse_err(b, &["`aa.weight`", &offset(at), "48", "Q8_0"]);
    assert!(matches!(err, GgufError::PartialBlock { row_len: 48, .. }));
}

#[test]
fn duplicate_tensor() {
    let mut b = valid();
    let at = find_str(&b, "cc.weight");
    b[at..at + 2].copy_from_slice(b"aa");
    let err = parse_err(b, &["`aa.weight`", &offset(at - 8), "twice"]);
    assert!(matches!(err, GgufError::DuplicateTensor { .. }));
}

/// Offset of a tensor info's data-offset field (tensors here have 1 or 2 dims).
fn data_offset_field(b: &[u8], tensor: &str, n_dims: usize) -> usize {
    n_dims_at(b, tensor) + 4 + 8 * n_dims + 4
}

#[test]
fn unaligned_tensor() {
    let mut b = valid();
    let at = data_offset_field(&b, "bb.weight", 2);
    let was = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    put_u64(&mut b, at, was + 4);
    let info_at = find_str(&b, "bb.weight") - 8;
    let err = parse_err(b, &["`bb.weight`", &offset(info_at), "alignment 32"]);
    assert!(matches!(err, GgufError::UnalignedTensor { alignment: 32, .. }));
}

#[test]
fn tensor_data_outside_the_file() {
    let b = valid();
    let info_at = find_str(&b, "cc.weight") - 8;
    // Cut the last tensor's data short.
    let cut = b.len() - 32;
    let err = parse_err(b[..cut].to_vec(), &["`cc.weight`", &offset(info_at), &cut.to_string()]);
    assert!(matches!(err, GgufError::TensorOutOfFile { file_bytes, .. } if file_bytes == cut as u64));
    // An offset near u64::MAX must not wrap around.
    let mut b = valid();
    let at = data_offset_field(&b, "cc.weight", 1);
    put_u64(&mut b, at, u64::MAX - 31);
    let err = parse_err(b, &["`cc.weight`", &offset(info_at)]);
    assert!(matches!(err, GgufError::TensorOutOfFile { .. }));
}

#[test]
fn overlapping_tensors() {
    let mut b = valid();
    let at = data_offset_field(&b, "bb.weight", 2);
    put_u64(&mut b, at, 0);
    let data_offset = GgufFile::from_bytes(NAME, valid()).unwrap().data_offset();
    let err = parse_err(b, &["`aa.weight`", "`bb.weight`", &offset(data_offset as usize)]);
    assert!(matches!(err, GgufError::OverlappingTensors { .. }));
}

#[test]
fn io_error_names_the_file() {
    let err = GgufFile::open("/nonexistent/strata/model.gguf").unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/strata/model.gguf"), "{err}");
}
