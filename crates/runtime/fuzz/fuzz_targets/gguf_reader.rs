//! Fuzzes the GGUF reader: any input must give `Ok` or a typed error, never a panic, and a
//! successfully parsed file must allow touching every metadata value and tensor byte.
#![no_main]

use ballast_runtime::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = (
        file.version(),
        file.file_len(),
        file.data_offset(),
        file.alignment(),
    );
    for (key, value) in file.metadata() {
        std::hint::black_box((key.len(), value.to_string(), value.type_description()));
        assert!(file.get(key).is_some());
    }
    for t in file.tensors() {
        let bytes = file.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        std::hint::black_box(bytes.iter().fold(0u8, |a, &b| a ^ b));
        assert!(file.tensor(&t.name).is_ok());
    }
});
