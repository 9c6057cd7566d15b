//! Malformed-GGUF corpus: every case must give a typed error of the expected variant (never a
//! panic), and the reader must never make a single allocation larger than the input plus a
//! small constant. A counting global allocator records the largest single allocation made by
//! the current thread while `GgufFile::from_bytes` runs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ballast_runtime::error::Error;
use ballast_runtime::ggml_type::GgmlType;
use ballast_runtime::gguf::{GgufFile, GgufWriter, Value, MAX_ARRAY_DEPTH};
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------

struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|m| {
        if size > m.get() {
            m.set(size)
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; `note` only
// records a size and allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc`'s contract, passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc`'s contract, passed on as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: the caller upholds `GlobalAlloc`'s contract, passed on as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `GlobalAlloc`'s contract, passed on as is.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Slack allowed above the input length for small bookkeeping allocations.
const ALLOC_SLACK: usize = 1024;

/// Parses `bytes`, returning the result and the largest single allocation made meanwhile.
fn parse_measured(bytes: &[u8]) -> (Result<GgufFile, Error>, usize) {
    let input = bytes.to_vec();
    LARGEST.with(|m| m.set(0));
    let r = GgufFile::from_bytes(input);
    let largest = LARGEST.with(|m| m.get());
    (r, largest)
}

/// Parses and checks the allocation bound; returns the result.
fn parse_bounded(name: &str, bytes: &[u8]) -> Result<GgufFile, Error> {
    let (r, largest) = parse_measured(bytes);
    assert!(
        largest <= bytes.len() + ALLOC_SLACK,
        "case {name}: largest allocation {largest} > input {} + {ALLOC_SLACK}",
        bytes.len()
    );
    r
}

// ---------------------------------------------------------------------------
// Raw byte builder for hand-made (malformed) files
// ---------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw::default()
            .bytes(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u8(self, x: u8) -> Raw {
        self.bytes(&[x])
    }
    fn u32(self, x: u32) -> Raw {
        self.bytes(&x.to_le_bytes())
    }
    fn u64(self, x: u64) -> Raw {
        self.bytes(&x.to_le_bytes())
    }
    /// A string with its real length.
    fn str(self, s: &[u8]) -> Raw {
        self.u64(s.len() as u64).bytes(s)
    }
    /// Metadata entry `key` of type u32.
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key.as_bytes()).u32(4).u32(v)
    }
    /// Tensor info.
    fn tensor(self, name: &[u8], dims: &[u64], ty: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }
    fn pad(mut self, align: usize) -> Raw {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        self
    }
    /// `n` bytes of non-zero filler data.
    fn data(mut self, n: usize) -> Raw {
        self.0.extend((0..n).map(|i| (i % 251) as u8 + 1));
        self
    }
}

/// One tensor with the given info fields, followed by `data_len` bytes of data.
fn one_tensor(name: &[u8], dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
    Raw::header(3, 1, 0)
        .tensor(name, dims, ty, offset)
        .pad(32)
        .data(data_len)
        .0
}

/// A file with one metadata entry `key` whose value is type `ty` followed by `value` bytes.
fn one_kv(ty: u32, value: Raw) -> Vec<u8> {
    Raw::header(3, 0, 1).str(b"k").u32(ty).bytes(&value.0).0
}

/// The valid small file the prefix and mutation tests start from: metadata of every type
/// (including nested arrays) and three tensors of different types.
fn valid_small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("a.u8", 7u8).unwrap();
    w.add_metadata("a.i8", -7i8).unwrap();
    w.add_metadata("a.u16", 700u16).unwrap();
    w.add_metadata("a.i16", -700i16).unwrap();
    w.add_metadata("a.u32", 70_000u32).unwrap();
    w.add_metadata("a.i32", -70_000i32).unwrap();
    w.add_metadata("a.f32", 1.5f32).unwrap();
    w.add_metadata("a.bool", true).unwrap();
    w.add_metadata("a.u64", u64::MAX).unwrap();
    w.add_metadata("a.i64", i64::MIN).unwrap();
    w.add_metadata("a.f64", -2.25f64).unwrap();
    w.add_metadata("a.strs", vec!["x", "yz", "é"]).unwrap();
    w.add_metadata("a.bools", vec![true, false]).unwrap();
    w.add_metadata("a.i32s", vec![1i32, -2, 3]).unwrap();
    w.add_metadata(
        "a.nested",
        Value::from(vec![
            ballast_runtime::gguf::Array::U8(vec![1, 2]),
            ballast_runtime::gguf::Array::String(vec!["q".into()]),
        ]),
    )
    .unwrap();
    let f32s: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 + 0.25).collect();
    w.add_tensor_f32("w.f32", &[3, 2], &f32s).unwrap();
    let q8: Vec<u8> = (0..34).map(|i| i as u8 + 1).collect();
    w.add_tensor("w.q8", GgmlType::Q8_0, &[32], q8).unwrap();
    let f16: Vec<u8> = (0..8).map(|i| i as u8 + 9).collect();
    w.add_tensor("w.f16", GgmlType::F16, &[4], f16).unwrap();
    w.to_bytes()
}

// ---------------------------------------------------------------------------
// Truncation at every byte
// ---------------------------------------------------------------------------

#[test]
fn every_prefix_of_a_valid_file_is_a_typed_error() {
    let full = valid_small_file();
    let ok = GgufFile::from_bytes(full.clone()).unwrap();
    let data_end = ok
        .tensors()
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    assert!(data_end < full.len(), "last tensor is followed by padding");
    for len in 0..=full.len() {
        let name = format!("prefix {len}");
        let r = parse_bounded(&name, &full[..len]);
        if len >= data_end {
            // Only trailing padding is missing: still a complete file.
            assert!(r.is_ok(), "{name}: {:?}", r.err());
            continue;
        }
        let e = r.err().unwrap_or_else(|| panic!("{name}: parsed"));
        assert!(
            matches!(
                e,
                Error::GgufTruncated { .. }
                    | Error::GgufStringTooLong { .. }
                    | Error::GgufCountTooLarge { .. }
                    | Error::GgufTensorOutOfBounds { .. }
            ),
            "{name}: unexpected {e:?}"
        );
        // Magic, version and tensor count: a prefix shorter than 16 bytes is truncated.
        if len < 16 {
            assert!(matches!(e, Error::GgufTruncated { .. }), "{name}: {e:?}");
        }
        assert!(e.to_string().contains("<memory>"), "{name}: {e}");
    }
}

#[test]
fn every_prefix_of_a_metadata_only_file_is_a_typed_error() {
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.tokens", vec!["a", "bb", "ccc"])
        .unwrap();
    w.add_metadata("x", 1u32).unwrap();
    let full = w.to_bytes();
    let header_end = 24 + 8 + 21 + 4 + 4 + 8 + (8 + 1) + (8 + 2) + (8 + 3) + (8 + 1) + 4 + 4;
    for len in 0..header_end {
        let r = parse_bounded("metadata prefix", &full[..len]);
        assert!(
            matches!(
                r,
                Err(Error::GgufTruncated { .. })
                    | Err(Error::GgufStringTooLong { .. })
                    | Err(Error::GgufCountTooLarge { .. })
            ),
            "prefix {len}: {:?}",
            r.map(|_| ())
        );
    }
    // Everything after the header is padding (no tensors).
    for len in header_end..=full.len() {
        assert!(
            GgufFile::from_bytes(full[..len].to_vec()).is_ok(),
            "prefix {len}"
        );
    }
}

// ---------------------------------------------------------------------------
// The table of hand-made malformed files
// ---------------------------------------------------------------------------

type Check = fn(&Error) -> bool;

macro_rules! case {
    ($name:expr, $bytes:expr, $pat:pat) => {
        (
            $name.to_string(),
            $bytes,
            (|e: &Error| matches!(e, $pat)) as Check,
        )
    };
}

fn nested_arrays(depth: usize) -> Raw {
    // `depth` nested arrays, each holding exactly one array, the innermost holding one u8.
    let mut r = Raw::header(3, 0, 1).str(b"bomb").u32(9);
    for _ in 0..depth - 1 {
        r = r.u32(9).u64(1);
    }
    r.u32(0).u64(1).u8(0)
}

fn corpus() -> Vec<(String, Vec<u8>, Check)> {
    use Error::*;
    let max = u64::MAX;
    let mut v = vec![
        // --- magic / endianness / version ---
        case!("empty file", vec![], GgufTruncated { .. }),
        case!("3 bytes", b"GGU".to_vec(), GgufTruncated { .. }),
        case!(
            "bad magic",
            Raw::default().bytes(b"GGML").u32(3).u64(0).u64(0).0,
            GgufBadMagic {
                found: [b'G', b'G', b'M', b'L'],
                ..
            }
        ),
        case!("zero magic", vec![0; 64], GgufBadMagic { .. }),
        case!(
            "big-endian magic",
            Raw::default()
                .bytes(b"FUGG")
                .bytes(&3u32.to_be_bytes())
                .u64(0)
                .u64(0)
                .0,
            GgufBigEndian { .. }
        ),
        case!(
            "big-endian version",
            Raw::default()
                .bytes(b"GGUF")
                .bytes(&3u32.to_be_bytes())
                .bytes(&0u64.to_be_bytes())
                .bytes(&0u64.to_be_bytes())
                .0,
            GgufBigEndian { .. }
        ),
        case!(
            "big-endian v2",
            Raw::default()
                .bytes(b"GGUF")
                .bytes(&2u32.to_be_bytes())
                .u64(0)
                .u64(0)
                .0,
            GgufBigEndian { .. }
        ),
        case!(
            "version 0",
            Raw::header(0, 0, 0).0,
            GgufUnsupportedVersion { version: 0, .. }
        ),
        case!(
            "version 1",
            Raw::header(1, 0, 0).0,
            GgufUnsupportedVersion { version: 1, .. }
        ),
        case!(
            "version 4",
            Raw::header(4, 0, 0).0,
            GgufUnsupportedVersion { version: 4, .. }
        ),
        case!(
            "version u32::MAX",
            Raw::header(u32::MAX, 0, 0).0,
            GgufUnsupportedVersion {
                version: u32::MAX,
                ..
            }
        ),
        case!(
            "truncated version",
            b"GGUF\x03\x00".to_vec(),
            GgufTruncated { .. }
        ),
        case!(
            "truncated counts",
            Raw::default().bytes(b"GGUF").u32(3).u64(0).0,
            GgufTruncated { .. }
        ),
        // --- counts past the end ---
        case!(
            "kv count past end",
            Raw::header(3, 0, 1000).kv_u32("a", 1).0,
            GgufCountTooLarge { count: 1000, .. }
        ),
        case!(
            "kv count u64::MAX",
            Raw::header(3, 0, max).0,
            GgufCountTooLarge { .. }
        ),
        case!(
            "kv count 2 with 1 entry",
            Raw::header(3, 0, 2).kv_u32("a", 1).0,
            GgufTruncated { .. } | GgufCountTooLarge { .. }
        ),
        case!(
            "tensor count past end",
            Raw::header(3, 1000, 0).data(64).0,
            GgufCountTooLarge { count: 1000, .. }
        ),
        case!(
            "tensor count u64::MAX",
            Raw::header(3, max, 0).0,
            GgufCountTooLarge { .. }
        ),
        case!(
            "tensor count past end after metadata",
            Raw::header(3, 2, 1)
                .str(b"k")
                .u32(8)
                .str(&[b'a'; 40])
                .tensor(b"t", &[1], 0, 0)
                .0,
            GgufCountTooLarge { count: 2, .. }
        ),
        // --- string lengths ---
        case!(
            "key length past end",
            Raw::header(3, 0, 1).u64(100).bytes(b"abcde").0,
            GgufStringTooLong { len: 100, .. }
        ),
        case!(
            "key length u64::MAX",
            Raw::header(3, 0, 1).u64(max).bytes(&[0; 16]).0,
            GgufStringTooLong { len: u64::MAX, .. }
        ),
        case!(
            "key length u64::MAX - 7",
            Raw::header(3, 0, 1).u64(max - 7).bytes(&[0; 16]).0,
            GgufStringTooLong { .. }
        ),
        case!(
            "key length 2^63",
            Raw::header(3, 0, 1).u64(1 << 63).bytes(&[0; 16]).0,
            GgufStringTooLong { .. }
        ),
        case!(
            "string value length past end",
            one_kv(8, Raw::default().u64(17).bytes(b"short")),
            GgufStringTooLong { len: 17, .. }
        ),
        case!(
            "string value length u64::MAX",
            one_kv(8, Raw::default().u64(max).bytes(&[1; 20])),
            GgufStringTooLong { .. }
        ),
        case!(
            "tensor name length u64::MAX",
            Raw::header(3, 1, 0).u64(max).u32(1).u64(1).u32(0).u64(0).0,
            GgufStringTooLong { .. }
        ),
        case!(
            "string array element length past end",
            one_kv(9, Raw::default().u32(8).u64(2).str(b"ok").u64(max - 1)),
            GgufStringTooLong { .. }
        ),
        // --- array lengths ---
        case!(
            "u32 array length past end",
            one_kv(9, Raw::default().u32(4).u64(1000).u32(1)),
            GgufCountTooLarge { count: 1000, .. }
        ),
        case!(
            "u8 array length u64::MAX",
            one_kv(9, Raw::default().u32(0).u64(max).data(32)),
            GgufCountTooLarge { .. }
        ),
        case!(
            "u64 array length u64::MAX/8",
            one_kv(9, Raw::default().u32(10).u64(max / 8).data(32)),
            GgufCountTooLarge { .. }
        ),
        case!(
            "string array length u64::MAX",
            one_kv(9, Raw::default().u32(8).u64(max).data(64)),
            GgufCountTooLarge { .. }
        ),
        case!(
            "string array length past end",
            one_kv(9, Raw::default().u32(8).u64(9).str(b"a")),
            GgufCountTooLarge { count: 9, .. }
        ),
        case!(
            "array element type truncated",
            one_kv(9, Raw::default().u32(8)),
            GgufTruncated { .. }
        ),
        // --- nested array bombs ---
        case!(
            "array of arrays length u64::MAX",
            one_kv(9, Raw::default().u32(9).u64(max).data(64)),
            GgufCountTooLarge { .. }
        ),
        case!(
            "array of arrays length past end",
            one_kv(9, Raw::default().u32(9).u64(100).u32(0).u64(0)),
            GgufCountTooLarge { count: 100, .. }
        ),
        case!(
            "inner array length u64::MAX",
            one_kv(9, Raw::default().u32(9).u64(1).u32(4).u64(max).data(16)),
            GgufCountTooLarge { .. }
        ),
        case!(
            "arrays nested one too deep",
            nested_arrays(MAX_ARRAY_DEPTH + 1).0,
            GgufNestingTooDeep {
                limit: MAX_ARRAY_DEPTH,
                ..
            }
        ),
        case!(
            "arrays nested 100000 deep",
            nested_arrays(100_000).0,
            GgufNestingTooDeep { .. }
        ),
        case!(
            "self-similar array bomb",
            {
                // Array of 2 arrays of 2 arrays ... each level claiming more than the rest holds.
                let mut r = Raw::header(3, 0, 1).str(b"bomb").u32(9);
                for _ in 0..20 {
                    r = r.u32(9).u64(2);
                }
                r.0
            },
            GgufNestingTooDeep { .. } | GgufCountTooLarge { .. }
        ),
        // --- value types ---
        case!(
            "unknown value type 13",
            one_kv(13, Raw::default().u32(0)),
            GgufUnknownValueType { type_id: 13, .. }
        ),
        case!(
            "unknown value type u32::MAX",
            one_kv(u32::MAX, Raw::default().u32(0)),
            GgufUnknownValueType {
                type_id: u32::MAX,
                ..
            }
        ),
        case!(
            "unknown array element type",
            one_kv(9, Raw::default().u32(77).u64(1).u32(0)),
            GgufUnknownValueType { type_id: 77, .. }
        ),
        case!(
            "bool byte 2",
            one_kv(7, Raw::default().u8(2)),
            GgufInvalidBool { value: 2, .. }
        ),
        case!(
            "bool byte 255 in array",
            one_kv(9, Raw::default().u32(7).u64(3).u8(1).u8(0).u8(255)),
            GgufInvalidBool { value: 255, .. }
        ),
        case!(
            "truncated u64 value",
            one_kv(10, Raw::default().u32(0)),
            GgufTruncated { .. }
        ),
        // --- UTF-8 ---
        case!(
            "non-UTF-8 key",
            Raw::header(3, 0, 1).str(b"ab\xffcd").u32(4).u32(1).0,
            GgufInvalidUtf8 { .. }
        ),
        case!(
            "non-UTF-8 string value",
            one_kv(8, Raw::default().str(b"\xc3\x28")),
            GgufInvalidUtf8 { .. }
        ),
        case!(
            "non-UTF-8 string array element",
            one_kv(
                9,
                Raw::default().u32(8).u64(2).str(b"ok").str(b"\xed\xa0\x80")
            ),
            GgufInvalidUtf8 { .. }
        ),
        case!(
            "non-UTF-8 tensor name",
            one_tensor(b"w\x80", &[8], 0, 0, 32),
            GgufInvalidUtf8 { .. }
        ),
        // --- duplicates ---
        case!(
            "duplicate key",
            Raw::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2).0,
            GgufDuplicateKey { .. }
        ),
        case!(
            "duplicate tensor name",
            Raw::header(3, 2, 0)
                .tensor(b"t", &[8], 0, 0)
                .tensor(b"t", &[8], 0, 32)
                .pad(32)
                .data(64)
                .0,
            GgufDuplicateTensor { .. }
        ),
        case!(
            "zero bytes read as tensor infos",
            Raw::header(3, 40, 0).bytes(&[0; 1000]).0,
            GgufDuplicateTensor { .. }
        ),
        case!(
            "zero bytes read as metadata entries",
            Raw::header(3, 0, 70).bytes(&[0; 1000]).0,
            GgufDuplicateKey { .. }
        ),
        case!(
            "alternating empty and named keys then bad type",
            {
                let mut r = Raw::header(3, 0, 81);
                for i in 0..40 {
                    r = r.str(b"").u32(0).u8(0);
                    r = r.str(format!("k{i}").as_bytes()).u32(0).u8(0);
                }
                r.str(b"x").u32(99).u32(0).0
            },
            GgufUnknownValueType { type_id: 99, .. }
        ),
        case!(
            "many tiny tensor infos then one out of bounds",
            {
                let mut r = Raw::header(3, 61, 0);
                for i in 0..60 {
                    r = r.tensor(format!("t{i}").as_bytes(), &[0], 0, 0);
                }
                r.tensor(b"last", &[8], 0, 1 << 20).pad(32).data(32).0
            },
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "wide array of empty arrays then bad value type",
            {
                let mut r = Raw::header(3, 0, 2).str(b"wide").u32(9).u32(9).u64(1000);
                for _ in 0..1000 {
                    r = r.u32(0).u64(0);
                }
                r.str(b"y").u32(13).u32(0).0
            },
            GgufUnknownValueType { type_id: 13, .. }
        ),
        case!(
            "many empty strings then bad bool",
            {
                let mut r = Raw::header(3, 0, 2).str(b"strs").u32(9).u32(8).u64(1000);
                for _ in 0..1000 {
                    r = r.u64(0);
                }
                r.str(b"b").u32(7).u8(7).0
            },
            GgufInvalidBool { value: 7, .. }
        ),
        case!(
            "overlapping tensors",
            Raw::header(3, 2, 0)
                .tensor(b"a", &[16], 0, 0)
                .tensor(b"b", &[8], 0, 32)
                .pad(32)
                .data(64)
                .0,
            GgufTensorOverlap { .. }
        ),
        case!(
            "same offset tensors",
            Raw::header(3, 2, 0)
                .tensor(b"a", &[8], 0, 0)
                .tensor(b"b", &[8], 0, 0)
                .pad(32)
                .data(64)
                .0,
            GgufTensorOverlap { .. }
        ),
        // --- dimensions ---
        case!(
            "n_dims 5",
            one_tensor(b"t", &[1, 1, 1, 1, 1], 0, 0, 32),
            GgufTooManyDims { n_dims: 5, .. }
        ),
        case!(
            "n_dims u32::MAX",
            Raw::header(3, 1, 0).str(b"t").u32(u32::MAX).data(64).0,
            GgufTooManyDims {
                n_dims: u32::MAX,
                ..
            }
        ),
        case!(
            "dims truncated",
            Raw::header(3, 1, 0)
                .str(b"tensor_name_long")
                .u32(4)
                .u64(1)
                .u64(1)
                .0,
            GgufTruncated { .. }
        ),
        case!(
            "element count overflows",
            one_tensor(b"t", &[1 << 32, 1 << 32, 2], 0, 0, 32),
            GgufTensorSizeOverflow {
                what: "element count",
                ..
            }
        ),
        case!(
            "element count overflows u64::MAX dims",
            one_tensor(b"t", &[max, max], 0, 0, 32),
            GgufTensorSizeOverflow {
                what: "element count",
                ..
            }
        ),
        case!(
            "byte size overflows",
            one_tensor(b"t", &[1 << 62], 0, 0, 32),
            GgufTensorSizeOverflow {
                what: "byte size",
                ..
            }
        ),
        case!(
            "byte size overflows q8_0",
            one_tensor(b"t", &[max - 31], 8, 0, 32),
            GgufTensorSizeOverflow {
                what: "byte size",
                ..
            }
        ),
        case!(
            "huge but representable tensor",
            one_tensor(b"t", &[1 << 40], 0, 0, 32),
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "row not a whole block",
            one_tensor(b"t", &[16], 2, 0, 32),
            GgufBlockMismatch {
                ne0: 16,
                block_len: 32,
                ..
            }
        ),
        // --- tensor types ---
        case!(
            "unknown tensor type 4",
            one_tensor(b"t", &[8], 4, 0, 32),
            GgufUnknownTensorType { type_id: 4, .. }
        ),
        case!(
            "unknown tensor type 99",
            one_tensor(b"t", &[8], 99, 0, 32),
            GgufUnknownTensorType { type_id: 99, .. }
        ),
        case!(
            "unknown tensor type u32::MAX",
            one_tensor(b"t", &[8], u32::MAX, 0, 32),
            GgufUnknownTensorType {
                type_id: u32::MAX,
                ..
            }
        ),
        // --- offsets ---
        case!(
            "offset past end",
            one_tensor(b"t", &[8], 0, 1 << 40, 32),
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "offset u64::MAX - 31",
            one_tensor(b"t", &[8], 0, max - 31, 32),
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "data runs past end",
            one_tensor(b"t", &[8], 0, 0, 31),
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "second tensor past end",
            Raw::header(3, 2, 0)
                .tensor(b"a", &[8], 0, 0)
                .tensor(b"b", &[8], 0, 32)
                .pad(32)
                .data(40)
                .0,
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "misaligned offset 1",
            one_tensor(b"t", &[8], 0, 1, 64),
            GgufMisalignedTensor {
                offset: 1,
                alignment: 32,
                ..
            }
        ),
        case!(
            "misaligned offset 16",
            one_tensor(b"t", &[8], 0, 16, 64),
            GgufMisalignedTensor { offset: 16, .. }
        ),
        // --- alignment ---
        case!(
            "alignment 0",
            Raw::header(3, 0, 1).kv_u32("general.alignment", 0).0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment 3",
            Raw::header(3, 0, 1).kv_u32("general.alignment", 3).0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment 2^31+1",
            Raw::header(3, 0, 1)
                .kv_u32("general.alignment", 0x8000_0001)
                .0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment u64 2^40",
            Raw::header(3, 0, 1)
                .str(b"general.alignment")
                .u32(10)
                .u64(1 << 40)
                .0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment u64::MAX",
            Raw::header(3, 0, 1)
                .str(b"general.alignment")
                .u32(10)
                .u64(max)
                .0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment negative",
            Raw::header(3, 0, 1)
                .str(b"general.alignment")
                .u32(5)
                .u32(-32i32 as u32)
                .0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment is a string",
            Raw::header(3, 0, 1)
                .str(b"general.alignment")
                .u32(8)
                .str(b"32")
                .0,
            GgufBadAlignment { .. }
        ),
        case!(
            "alignment 2^31 pushes data past end",
            Raw::header(3, 1, 1)
                .kv_u32("general.alignment", 1 << 31)
                .tensor(b"t", &[8], 0, 0)
                .data(64)
                .0,
            GgufTensorOutOfBounds { .. }
        ),
        case!(
            "offset misaligned for alignment 64",
            Raw::header(3, 1, 1)
                .kv_u32("general.alignment", 64)
                .tensor(b"t", &[8], 0, 32)
                .pad(64)
                .data(128)
                .0,
            GgufMisalignedTensor { alignment: 64, .. }
        ),
    ];
    // Single-byte overwrites of the valid file at known fields.
    let base = valid_small_file();
    let mut bad_ver = base.clone();
    bad_ver[4] = 9;
    v.push(case!(
        "valid file with version 9",
        bad_ver,
        GgufUnsupportedVersion { version: 9, .. }
    ));
    let mut bad_magic = base.clone();
    bad_magic[0] = b'X';
    v.push(case!(
        "valid file with bad magic",
        bad_magic,
        GgufBadMagic { .. }
    ));
    let mut huge_kv = base.clone();
    huge_kv[16..24].copy_from_slice(&max.to_le_bytes());
    v.push(case!(
        "valid file with kv count u64::MAX",
        huge_kv,
        GgufCountTooLarge { .. }
    ));
    let mut huge_t = base.clone();
    huge_t[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    v.push(case!(
        "valid file with tensor count 2^40",
        huge_t,
        GgufCountTooLarge { .. }
    ));
    let mut huge_key = base;
    huge_key[24..32].copy_from_slice(&(max - 3).to_le_bytes());
    v.push(case!(
        "valid file with first key length u64::MAX-3",
        huge_key,
        GgufStringTooLong { .. }
    ));
    v
}

#[test]
fn malformed_corpus_gives_expected_typed_errors_within_allocation_bound() {
    let cases = corpus();
    assert!(cases.len() > 70);
    for (name, bytes, check) in cases {
        match parse_bounded(&name, &bytes) {
            Ok(_) => panic!("case {name}: parsed successfully"),
            Err(e) => {
                assert!(check(&e), "case {name}: unexpected error variant {e:?}");
                let msg = e.to_string();
                assert!(msg.starts_with("<memory>: "), "case {name}: message {msg}");
            }
        }
    }
}

#[test]
fn error_messages_name_the_tensor_key_or_limit() {
    let e = GgufFile::from_bytes(one_tensor(b"blk.0.ffn", &[8], 99, 0, 32)).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("blk.0.ffn") && s.contains("99"), "{s}");
    let e = GgufFile::from_bytes(one_tensor(b"tok_embd", &[1 << 32, 1 << 32, 2], 0, 0, 32))
        .unwrap_err();
    assert!(e.to_string().contains("tok_embd"), "{e}");
    let e = GgufFile::from_bytes(one_tensor(b"x", &[1; 5], 0, 0, 32)).unwrap_err();
    assert!(e.to_string().contains("limit of 4"), "{e}");
    let e = GgufFile::from_bytes(nested_arrays(MAX_ARRAY_DEPTH + 1).0).unwrap_err();
    assert!(e.to_string().contains("'bomb'"), "{e}");
    let e = GgufFile::from_bytes(one_kv(8, Raw::default().u64(17).bytes(b"short"))).unwrap_err();
    assert!(e.to_string().contains("metadata key 'k'"), "{e}");
    let e =
        GgufFile::from_bytes(Raw::header(3, 0, 1).kv_u32("general.alignment", 3).0).unwrap_err();
    assert!(
        e.to_string().contains("general.alignment") && e.to_string().contains('3'),
        "{e}"
    );
}

#[test]
fn edge_cases_that_are_valid() {
    // Dimensions of 0 are accepted, as llama.cpp does; such a tensor has no data.
    let f = parse_bounded("zero dim", &one_tensor(b"t", &[0, 4], 0, 0, 0)).unwrap();
    assert_eq!(f.tensors()[0].n_bytes, 0);
    assert_eq!(f.tensor_data(&f.tensors()[0]), &[] as &[u8]);
    // Zero dimensions: a scalar of one element.
    let f = parse_bounded("scalar", &one_tensor(b"s", &[], 0, 0, 4)).unwrap();
    assert_eq!(f.tensors()[0].n_bytes, 4);
    // Exactly the maximum nesting.
    let f = parse_bounded("max nesting", &nested_arrays(MAX_ARRAY_DEPTH).0).unwrap();
    assert!(f.get("bomb").is_some());
    // Version 2 has the same layout as version 3.
    let mut v2 = valid_small_file();
    v2[4] = 2;
    assert_eq!(parse_bounded("v2", &v2).unwrap().version(), 2);
    // Alignment given as another integer type is accepted.
    let f = parse_bounded(
        "u64 alignment",
        &Raw::header(3, 1, 1)
            .str(b"general.alignment")
            .u32(10)
            .u64(16)
            .tensor(b"t", &[4], 0, 16)
            .pad(16)
            .data(32)
            .0,
    )
    .unwrap();
    assert_eq!(f.alignment(), 16);
    assert_eq!(f.tensors()[0].offset, f.data_offset() + 16);
}

#[test]
fn valid_file_parses_within_allocation_bound() {
    let bytes = valid_small_file();
    let f = parse_bounded("valid", &bytes).unwrap();
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.metadata().len(), 16);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random byte overwrites of the valid file never panic nor over-allocate.
    #[test]
    fn random_overwrites_never_panic(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = valid_small_file();
        for (i, b) in &edits {
            let at = i.index(bytes.len());
            bytes[at] = *b;
        }
        let (r, largest) = parse_measured(&bytes);
        prop_assert!(largest <= bytes.len() + ALLOC_SLACK, "largest allocation {}", largest);
        if let Ok(f) = r {
            for (_, v) in f.metadata() {
                let _ = v.to_string();
            }
            for t in f.tensors() {
                let _ = f.tensor_data(t).iter().map(|&b| b as u64).sum::<u64>();
            }
        }
    }

    /// Random bit flips anywhere in the header region.
    #[test]
    fn random_bit_flips_never_panic(flips in proptest::collection::vec((0usize..600, 0u8..8), 1..4)) {
        let mut bytes = valid_small_file();
        for (i, bit) in &flips {
            let at = i % bytes.len();
            bytes[at] ^= 1 << bit;
        }
        let (r, largest) = parse_measured(&bytes);
        prop_assert!(largest <= bytes.len() + ALLOC_SLACK, "largest allocation {}", largest);
        drop(r);
    }

    /// Random u64 overwrites at 8-byte-aligned positions (hits counts and lengths).
    #[test]
    fn random_u64_overwrites_never_panic(at in 0usize..80, x in prop_oneof![any::<u64>(), Just(u64::MAX), 0u64..1000]) {
        let mut bytes = valid_small_file();
        let at = (at * 8).min(bytes.len() - 8);
        bytes[at..at + 8].copy_from_slice(&x.to_le_bytes());
        let (r, largest) = parse_measured(&bytes);
        prop_assert!(largest <= bytes.len() + ALLOC_SLACK, "largest allocation {}", largest);
        drop(r);
    }
}

/// Runs every file of the directory named by `GGUF_CORPUS_DIR` (e.g. a cargo-fuzz corpus)
/// through the reader. Does nothing when the variable is unset.
///
/// Malformed files must stay within input + slack. *Valid* files made of many minimal entries
/// (e.g. hundreds of 24-byte tensor infos with distinct one-letter names and a zero dimension)
/// legitimately need more memory than their size, because a parsed entry is larger than its
/// smallest encoding (`size_of::<TensorInfo>()` = 72 vs 24 bytes, `(String, Value)` vs 13
/// bytes); for those the bound is that ratio times the input.
#[test]
fn external_corpus_within_allocation_bound() {
    let Some(dir) = std::env::var_os("GGUF_CORPUS_DIR") else {
        return;
    };
    let ratio = (std::mem::size_of::<(String, Value)>() / 13 + 1)
        .max(std::mem::size_of::<ballast_runtime::gguf::TensorInfo>() / 24 + 1);
    let (mut n, mut over) = (0, 0);
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let (r, largest) = parse_measured(&bytes);
        if largest > bytes.len() + ALLOC_SLACK {
            over += 1;
        }
        // Malformed files are rejected by the validating pass, before any big allocation.
        assert!(
            r.is_ok() || largest <= bytes.len() + ALLOC_SLACK,
            "{}: malformed file ({:?}) allocated {largest} > input {} + {ALLOC_SLACK}",
            path.display(),
            r.err(),
            bytes.len()
        );
        assert!(
            largest <= ratio * bytes.len() + ALLOC_SLACK,
            "{}: largest allocation {largest} > {ratio} x input {}",
            path.display(),
            bytes.len()
        );
        n += 1;
    }
    eprintln!("checked {n} corpus files; {over} above input + {ALLOC_SLACK}; ratio bound {ratio}");
}
