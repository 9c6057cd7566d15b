//! The engine builder on tiny random-weight models: the stores it chooses, the tokens
//! they give, the errors it reports.

use std::path::{Path, PathBuf};

use ballast::runtime::testing::TinyModelSpec;
use ballast::{
    ByteSize, Engine, Error, Eviction, GenerateOptions, KvOptions, SamplerConfig, Step, StoreKind,
};

/// A model of six layers, 256 wide, written into `dir`.
fn layered_model(dir: &Path) -> PathBuf {
    let path = dir.join("layered.gguf");
    let spec = TinyModelSpec {
        n_layers: 6,
        d_model: 256,
        n_ff: 512,
        ..TinyModelSpec::default()
    };
    std::fs::write(&path, spec.to_gguf_bytes().unwrap()).unwrap();
    path
}

/// Twelve greedy token ids from `engine` after "Hello".
fn greedy_ids(engine: Engine) -> Vec<u32> {
    let prompt = engine.tokenizer().encode("Hello", true, false).unwrap();
    let options = GenerateOptions {
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        max_tokens: Some(12),
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    let mut generator = engine.generator(options).unwrap();
    generator.prompt(&prompt).unwrap();
    let mut ids = Vec::new();
    while let Step::Token(token) = generator.step().unwrap() {
        ids.push(token.id);
    }
    ids
}

fn mib(n: u64) -> ByteSize {
    ByteSize(n << 20)
}

#[test]
fn tiered_streaming_gives_the_tokens_of_the_memory_map() {
    let dir = tempfile::tempdir().unwrap();
    let path = layered_model(dir.path());
    let mapped = Engine::builder(&path)
        .store(StoreKind::Mmap)
        .threads(1)
        .context(64)
        .build()
        .unwrap();
    assert_eq!(mapped.report().store, "mmap");
    assert!(mapped.report().plan().is_none());
    let tiered = Engine::builder(&path)
        .ram_budget(mib(64))
        .threads(1)
        .context(64)
        .build()
        .unwrap();
    // A budget makes the automatic store stream by tiers, and the report says so.
    assert_eq!(tiered.report().store, "tiered");
    let plan = tiered.report().plan().expect("a tiered store has a plan");
    assert_eq!(plan.tiers.len(), 6);
    let text = tiered.report().to_string();
    assert!(text.starts_with("RAM budget 64.0 MiB (given)"), "{text}");
    assert!(text.contains("| C disk |"), "{text}");
    assert_eq!(greedy_ids(mapped), greedy_ids(tiered));
}

#[test]
fn a_budget_too_small_for_one_layer_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = layered_model(dir.path());
    let err = Engine::builder(&path)
        .store(StoreKind::Tiered)
        .ram_budget(ByteSize(1 << 20))
        .context(64)
        .build()
        .err()
        .expect("1 MiB holds no layer");
    assert!(
        matches!(err, Error::Budget { budget, .. } if budget == 1 << 20),
        "{err:?}"
    );
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(
        chain.contains("too small") && chain.contains("bytes are needed"),
        "{chain}"
    );
}

#[test]
fn a_context_too_long_for_the_budget_says_which_fits() {
    let dir = tempfile::tempdir().unwrap();
    let path = layered_model(dir.path());
    let err = Engine::builder(&path)
        .ram_budget(mib(16))
        .context(1 << 20)
        .build()
        .err()
        .expect("a million tokens of KV do not fit 16 MiB");
    let Error::ContextTooLong(c) = err else {
        panic!("{err:?}");
    };
    assert_eq!(c.ctx, 1 << 20);
    assert!(c.fits > 0 && c.fits < c.ctx, "{c:?}");
    // The context that fits builds.
    Engine::builder(&path)
        .ram_budget(mib(16))
        .context(c.fits as usize)
        .build()
        .unwrap();
}

#[test]
fn sessions_get_the_kv_options() {
    let dir = tempfile::tempdir().unwrap();
    let path = layered_model(dir.path());
    let engine = Engine::builder(&path)
        .store(StoreKind::Mmap)
        .kv(KvOptions {
            policy: Eviction::Streaming,
            sink: 4,
            window: Some(28),
            ..KvOptions::default()
        })
        .context(64)
        .build()
        .unwrap();
    let shared = engine.shared_session().unwrap();
    assert!(shared.policy().is_some());
    assert_eq!(shared.kv().capacity(), 32);
    assert!(shared.model().shares_weights_with(engine.model()));
    let own = engine.session().unwrap();
    assert!(own.policy().is_some());
    assert_eq!(own.kv().capacity(), 32);
}

#[test]
fn the_compressed_store_needs_a_pack() {
    let dir = tempfile::tempdir().unwrap();
    let path = layered_model(dir.path());
    let err = Engine::builder(&path)
        .store(StoreKind::Compressed)
        .build()
        .err()
        .expect("a GGUF is no pack");
    assert!(matches!(err, Error::Invalid(_)), "{err:?}");
    assert!(err.to_string().contains("needs a pack"), "{err}");
}

#[test]
fn a_missing_file_is_named() {
    let err = Engine::builder("/nonexistent/model.gguf")
        .build()
        .err()
        .expect("no such file");
    assert!(
        matches!(&err, Error::File { action: "opening", path, .. } if path == Path::new("/nonexistent/model.gguf")),
        "{err:?}"
    );
}
