//! The resident set of two sessions on one model: a test of its own, so that no other
//! test's allocations in the same process blur the figure.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::memory::current_rss_kib;
use ballast_runtime::{CpuBackend, Model, Session};

fn generate(session: &mut Session, prompt: &[u32], steps: usize) {
    let mut next = session.feed_greedy(prompt).unwrap();
    for _ in 1..steps {
        next = session.feed_greedy(&[next]).unwrap();
    }
}

/// The default model read into RAM: a second session adds its KV cache and activation
/// buffers to the resident set, not a second copy of the weights. Prints the figures.
#[test]
fn a_second_session_does_not_copy_the_weights() {
    let path = ballast_runtime::model_cache::ensure_default_model(|line| eprintln!("{line}"))
        .expect("the default model (cargo xtask fetch-model)");
    let file = Arc::new(GgufFile::open(&path, false).unwrap());
    let model = Model::load(file, Arc::new(CpuBackend::new(2)), false).unwrap();
    let weights = model.store().held_bytes().total();
    let Some(loaded) = current_rss_kib() else {
        eprintln!("skipped: no RSS figure on this platform");
        return;
    };
    let prompt: Vec<u32> = (1..64).collect();
    let mut first = Session::new(model.share(), 512).unwrap();
    generate(&mut first, &prompt, 16);
    let one = current_rss_kib().unwrap();
    let mut second = Session::new(model.share(), 512).unwrap();
    generate(&mut second, &prompt, 16);
    let two = current_rss_kib().unwrap();
    let kv = second.kv().held_bytes().total();
    let grown = (two.saturating_sub(one)) * 1024;
    eprintln!(
        "weights {weights} B; RSS after load {loaded} KiB, one session {one} KiB, two sessions {two} KiB; \
         the second session added {grown} B (its KV cache holds {kv} B)"
    );
    assert!(
        grown < weights / 2,
        "a second session grew the resident set by {grown} B, the weights are {weights} B"
    );
}
