//! GGUF writer/reader round trips, typed getters, display, files and mmap.

use ballast_runtime::error::Error;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::{Array, GgufFile, GgufWriter, Value, ValueType};
use proptest::prelude::*;

fn small_model() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.block_count", 2u64).unwrap();
    w.add_metadata("llama.context_length", 128i32).unwrap();
    w.add_metadata("llama.neg", -1i32).unwrap();
    w.add_metadata("llama.big", u64::MAX).unwrap();
    w.add_metadata("llama.rope.freq_base", 10000.0f32).unwrap();
    w.add_metadata("llama.eps64", 1e-5f64).unwrap();
    w.add_metadata("tokenizer.ggml.add_bos_token", true)
        .unwrap();
    w.add_metadata("tokenizer.ggml.tokens", vec!["<s>", "</s>", "a"])
        .unwrap();
    w.add_metadata("tokenizer.ggml.token_type", vec![3i32, 3, 1])
        .unwrap();
    w.add_metadata("tokenizer.ggml.ids_u8", vec![1u8, 2, 3])
        .unwrap();
    w.add_metadata("tokenizer.ggml.scores", vec![0.0f32, -1.0, -2.5])
        .unwrap();
    w.add_tensor_f32("token_embd.weight", &[4, 3], &[0.5; 12])
        .unwrap();
    w
}

#[test]
fn typed_getters() {
    let f = GgufFile::from_bytes(small_model().to_bytes()).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 128);
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_i32("llama.neg").unwrap(), -1);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(f.get_f32("llama.eps64").unwrap(), 1e-5f64 as f32);
    assert!(f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap(),
        ["<s>", "</s>", "a"]
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        [3, 3, 1]
    );
    assert_eq!(
        f.get_u32_array("tokenizer.ggml.token_type").unwrap(),
        [3, 3, 1]
    );
    assert_eq!(f.get_u32_array("tokenizer.ggml.ids_u8").unwrap(), [1, 2, 3]);
    assert_eq!(
        f.get_f32_array("tokenizer.ggml.scores").unwrap(),
        [0.0, -1.0, -2.5]
    );

    // Optional variants.
    assert_eq!(f.get_u32_opt("nope").unwrap(), None);
    assert_eq!(f.get_u32_opt("llama.block_count").unwrap(), Some(2));
    assert_eq!(
        f.get_str_opt("general.architecture").unwrap(),
        Some("llama")
    );
    assert_eq!(f.get_bool_opt("nope").unwrap(), None);
    assert_eq!(f.get_f32_opt("nope").unwrap(), None);
    assert_eq!(f.get_str_array_opt("nope").unwrap(), None);
    assert_eq!(f.get_i32_array_opt("nope").unwrap(), None);
    assert_eq!(f.get_u32_array_opt("nope").unwrap(), None);
    assert_eq!(f.get_f32_array_opt("nope").unwrap(), None);
    assert_eq!(f.get_u64_opt("nope").unwrap(), None);
    assert_eq!(f.get_i32_opt("nope").unwrap(), None);
    assert!(f.get_u32_opt("general.architecture").is_err());

    // Errors name the key.
    let e = f.get_u32("missing.key").unwrap_err();
    assert!(matches!(&e, Error::GgufMissingKey { key, .. } if key == "missing.key"));
    assert!(e.to_string().contains("missing.key") && e.to_string().contains("<memory>"));
    let e = f.get_u32("general.architecture").unwrap_err();
    assert!(
        matches!(&e, Error::GgufWrongType { key, .. } if key == "general.architecture"),
        "{e:?}"
    );
    assert!(matches!(
        f.get_u32("llama.neg"),
        Err(Error::GgufValueOutOfRange { .. })
    ));
    assert!(matches!(
        f.get_u32("llama.big"),
        Err(Error::GgufValueOutOfRange { .. })
    ));
    assert!(matches!(
        f.get_i32_array("tokenizer.ggml.tokens"),
        Err(Error::GgufWrongType { .. })
    ));
    assert!(matches!(
        f.get_str_array("tokenizer.ggml.token_type"),
        Err(Error::GgufWrongType { .. })
    ));
    assert!(matches!(
        f.get_bool("llama.neg"),
        Err(Error::GgufWrongType { .. })
    ));
    assert!(matches!(
        f.get_f32("llama.neg"),
        Err(Error::GgufWrongType { .. })
    ));
    assert!(matches!(
        f.get_str("llama.neg"),
        Err(Error::GgufWrongType { .. })
    ));

    // Tensors.
    let t = f.tensor("token_embd.weight").unwrap();
    assert_eq!(t.dims, [4, 3]);
    assert_eq!(t.ty, GgmlType::F32);
    assert_eq!(t.n_bytes, 48);
    assert_eq!(t.n_elements(), 12);
    assert_eq!(t.offset, f.data_offset());
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.tensor_data(t).len(), 48);
    let e = f.tensor("output.weight").unwrap_err();
    assert!(matches!(&e, Error::GgufMissingTensor { tensor, .. } if tensor == "output.weight"));
    assert!(e.to_string().contains("output.weight"));
}

#[test]
fn display_abbreviates_long_arrays() {
    let v = Value::from((0..100u32).collect::<Vec<_>>());
    assert_eq!(v.to_string(), "[0, 1, 2, 3, 4, 5, 6, 7, ... (100 items)]");
    assert_eq!(Value::from(vec![1i8, 2]).to_string(), "[1, 2]");
    assert_eq!(Value::from("hi").to_string(), "\"hi\"");
    let long = "x".repeat(100);
    assert!(Value::from(long.as_str())
        .to_string()
        .ends_with("... (100 chars)"));
    let nested = Value::from(vec![Array::U8(vec![1]), Array::String(vec!["a".into()])]);
    assert_eq!(nested.to_string(), "[[1], [\"a\"]]");
    assert_eq!(nested.type_description(), "array of array");
    assert_eq!(Value::Bool(true).to_string(), "true");
    assert_eq!(Value::F32(1.5).to_string(), "1.5");
    assert_eq!(ValueType::from_id(9), Some(ValueType::Array));
    assert_eq!(ValueType::from_id(13), None);
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("t", GgmlType::F32, &[4], vec![0u8; 15]),
        Err(Error::GgufWriterInvalid { .. })
    ));
    assert!(w
        .add_tensor("q", GgmlType::Q4_0, &[16], vec![0u8; 9])
        .is_err());
    assert!(w
        .add_tensor("d", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0u8; 4])
        .is_err());
    assert!(w
        .add_tensor("o", GgmlType::F32, &[1 << 40, 1 << 40], vec![])
        .is_err());
    w.add_tensor("t", GgmlType::F32, &[4], vec![0u8; 16])
        .unwrap();
    let e = w
        .add_tensor("t", GgmlType::F32, &[4], vec![0u8; 16])
        .unwrap_err();
    assert!(e.to_string().contains("'t'"), "{e}");
    w.add_metadata("k", 1u8).unwrap();
    assert!(w.add_metadata("k", 2u8).is_err());
    assert!(w.add_metadata("general.alignment", 3u32).is_err());
    assert!(w.set_alignment(0).is_err());
    assert!(w.set_alignment(48).is_err());
    let mut deep = Array::U8(vec![1]);
    for _ in 0..ballast_runtime::gguf::MAX_ARRAY_DEPTH {
        deep = Array::Array(vec![deep]);
    }
    let e = w.add_metadata("deep", Value::Array(deep)).unwrap_err();
    assert!(
        e.to_string().contains("'deep'") && e.to_string().contains("limit of 8"),
        "{e}"
    );
    let e = w
        .add_tensor("q2", GgmlType::Q4_0, &[16], vec![0u8; 9])
        .unwrap_err();
    assert!(e.to_string().contains("block length 32"), "{e}");
}

#[test]
fn alignment_and_q_types() {
    let mut w = GgufWriter::new();
    w.set_alignment(64).unwrap();
    w.add_tensor("a", GgmlType::F16, &[3], vec![1u8; 6])
        .unwrap();
    w.add_tensor("b", GgmlType::Q4_K, &[256, 2], vec![2u8; 288])
        .unwrap();
    w.add_tensor("c", GgmlType::Q8_0, &[64], vec![3u8; 68])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.get_u32("general.alignment").unwrap(), 64);
    for t in f.tensors() {
        assert_eq!((t.offset - f.data_offset()) % 64, 0);
    }
    assert_eq!(f.tensor_data(f.tensor("b").unwrap()), &[2u8; 288][..]);
    assert_eq!(f.tensor_data(f.tensor("c").unwrap()), &[3u8; 68][..]);

    // general.alignment given through add_metadata also takes effect.
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", 8u64).unwrap();
    w.add_tensor("a", GgmlType::F32, &[1], vec![1u8; 4])
        .unwrap();
    w.add_tensor("b", GgmlType::F32, &[1], vec![2u8; 4])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 8);
    assert_eq!(f.tensor("b").unwrap().offset - f.data_offset(), 8);
}

#[test]
fn write_file_atomically_and_open_with_and_without_mmap() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let w = small_model();
    w.write_to_file(&path).unwrap();
    // Overwrite in place works too, and leaves no temporary file behind.
    w.write_to_file(&path).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["m.gguf"]);
    for mmap in [true, false] {
        let f = GgufFile::open(&path, mmap).unwrap();
        assert_eq!(f.path(), path);
        assert_eq!(f.file_len(), std::fs::metadata(&path).unwrap().len());
        assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
        let t = f.tensor("token_embd.weight").unwrap();
        assert_eq!(f.tensor_data(t), &[0.5f32.to_le_bytes(); 12].concat()[..]);
    }
    let e = GgufFile::open(&dir.path().join("nope.gguf"), true).unwrap_err();
    assert!(matches!(&e, Error::FileIo { .. }));
    assert!(e.to_string().contains("nope.gguf"));
    // An empty file is truncated, mapped or not.
    std::fs::write(dir.path().join("empty.gguf"), b"").unwrap();
    for mmap in [true, false] {
        let e = GgufFile::open(&dir.path().join("empty.gguf"), mmap).unwrap_err();
        assert!(matches!(e, Error::GgufTruncated { offset: 0, .. }), "{e:?}");
    }
    // Errors of an opened file name its path.
    std::fs::write(dir.path().join("bad.gguf"), b"GGUF\x01\0\0\0").unwrap();
    let e = GgufFile::open(&dir.path().join("bad.gguf"), false).unwrap_err();
    assert!(matches!(
        e,
        Error::GgufUnsupportedVersion { version: 1, .. }
    ));
    assert!(e.to_string().contains("bad.gguf"), "{e}");
}

// ---------------------------------------------------------------------------
// Property: anything written reads back the same.
// ---------------------------------------------------------------------------

fn arb_leaf_array() -> impl Strategy<Value = Array> {
    use proptest::collection::vec;
    prop_oneof![
        vec(any::<u8>(), 0..6).prop_map(Array::U8),
        vec(any::<i8>(), 0..6).prop_map(Array::I8),
        vec(any::<u16>(), 0..6).prop_map(Array::U16),
        vec(any::<i16>(), 0..6).prop_map(Array::I16),
        vec(any::<u32>(), 0..6).prop_map(Array::U32),
        vec(any::<i32>(), 0..6).prop_map(Array::I32),
        vec(-1e30f32..1e30, 0..6).prop_map(Array::F32),
        vec(any::<bool>(), 0..6).prop_map(Array::Bool),
        vec(".{0,6}", 0..6).prop_map(Array::String),
        vec(any::<u64>(), 0..6).prop_map(Array::U64),
        vec(any::<i64>(), 0..6).prop_map(Array::I64),
        vec(-1e300f64..1e300, 0..6).prop_map(Array::F64),
    ]
}

fn arb_array() -> impl Strategy<Value = Array> {
    arb_leaf_array().prop_recursive(3, 24, 4, |inner| {
        proptest::collection::vec(inner, 0..4).prop_map(Array::Array)
    })
}

fn arb_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        (-1e30f32..1e30).prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::String),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        (-1e300f64..1e300).prop_map(Value::F64),
        arb_array().prop_map(Value::Array),
    ]
}

/// (type, dims with ne0 in blocks, data seed)
fn arb_tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, u64)> {
    (
        proptest::sample::select(GgmlType::ALL.to_vec()),
        proptest::collection::vec(0u64..4, 0..=4),
        any::<u64>(),
    )
        .prop_map(|(ty, mut dims, seed)| {
            if let Some(d0) = dims.first_mut() {
                *d0 *= ty.block_len() as u64;
            }
            (ty, dims, seed)
        })
        .prop_filter("scalar block types need a whole block", |(ty, dims, _)| {
            !dims.is_empty() || ty.block_len() == 1
        })
}

fn fill(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn written_files_read_back_identically(
        metadata in proptest::collection::btree_map("[a-z][a-z0-9._]{0,11}", arb_value(), 0..10),
        tensors in proptest::collection::vec(arb_tensor(), 0..5),
        alignment in proptest::sample::select(vec![0u32, 1, 8, 32, 64, 256]),
    ) {
        let mut w = GgufWriter::new();
        if alignment != 0 {
            w.set_alignment(alignment).unwrap();
        }
        let mut expected_meta: Vec<(String, Value)> = w_meta(&w, alignment);
        for (k, v) in &metadata {
            w.add_metadata(k.clone(), v.clone()).unwrap();
            expected_meta.push((k.clone(), v.clone()));
        }
        let mut expected_tensors = Vec::new();
        for (i, (ty, dims, seed)) in tensors.iter().enumerate() {
            let n: u64 = dims.iter().product();
            let bytes = fill(ty.bytes_for(n).unwrap() as usize, *seed);
            let name = format!("blk.{i}.weight");
            w.add_tensor(name.clone(), *ty, dims, bytes.clone()).unwrap();
            expected_tensors.push((name, *ty, dims.clone(), bytes));
        }
        let bytes = w.to_bytes();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        prop_assert_eq!(f.version(), 3);
        prop_assert_eq!(f.metadata(), &expected_meta[..]);
        for (k, v) in &expected_meta {
            prop_assert_eq!(f.get(k), Some(v));
        }
        let align = if alignment == 0 { 32 } else { alignment as u64 };
        prop_assert_eq!(f.alignment(), align);
        prop_assert_eq!(f.data_offset() % align, 0);
        prop_assert_eq!(f.tensors().len(), expected_tensors.len());
        for (t, (name, ty, dims, data)) in f.tensors().iter().zip(&expected_tensors) {
            prop_assert_eq!(&t.name, name);
            prop_assert_eq!(t.ty, *ty);
            prop_assert_eq!(&t.dims, dims);
            prop_assert_eq!((t.offset - f.data_offset()) % align, 0);
            prop_assert_eq!(f.tensor_data(t), &data[..]);
        }
        // Display never panics and writing is deterministic.
        for (_, v) in f.metadata() {
            let _ = v.to_string();
        }
        prop_assert_eq!(w.to_bytes(), bytes);
    }
}

/// Metadata the writer adds by itself (`general.alignment` when set).
fn w_meta(_w: &GgufWriter, alignment: u32) -> Vec<(String, Value)> {
    if alignment == 0 {
        vec![]
    } else {
        vec![("general.alignment".to_string(), Value::U32(alignment))]
    }
}
