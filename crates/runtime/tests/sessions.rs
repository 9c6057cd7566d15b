//! Sessions apart from the model: several sessions on one loaded model (handles from
//! `Model::share`), run one after another, interleaved, or from different threads, give
//! exactly the tokens of separate runs, and the weights are held once.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::{TinyModelSpec, TINY_VOCAB};
use ballast_runtime::{Backend, CpuBackend, Model, Session};

const PROMPTS: [&[u32]; 2] = [&[72, 101, 108, 108, 111, 44, 32], &[3, 256, 17, 99]];
const STEPS: usize = 12;

fn tiny(backend: Arc<dyn Backend>) -> Model {
    let spec = TinyModelSpec {
        n_layers: 3,
        ..TinyModelSpec::default()
    };
    let file = Arc::new(GgufFile::from_bytes(spec.to_gguf_bytes().unwrap()).unwrap());
    Model::load(file, backend, false).unwrap()
}

/// A session with the model's default cache: on wgpu each session's rows live on the
/// device in a cache of its own, so interleaving sessions moves no keys or values.
fn session(model: Model) -> Session {
    Session::new(model, 64).unwrap()
}

/// Greedy ids after `prompt`, `STEPS` of them.
fn generate(session: &mut Session, prompt: &[u32]) -> Vec<u32> {
    let mut next = session.feed_greedy(prompt).unwrap();
    let mut out = vec![next];
    for _ in 1..STEPS {
        next = session.feed_greedy(&[next]).unwrap();
        out.push(next);
    }
    out
}

/// Each prompt on a model of its own: the reference.
fn separate_runs(backend: &Arc<dyn Backend>) -> Vec<Vec<u32>> {
    PROMPTS
        .iter()
        .map(|p| generate(&mut session(tiny(backend.clone())), p))
        .collect()
}

fn check_backend(backend: Arc<dyn Backend>) {
    let expected = separate_runs(&backend);
    assert!(expected[0] != expected[1], "prompts must lead apart");
    assert!(expected
        .iter()
        .flatten()
        .all(|&id| (id as usize) < TINY_VOCAB));

    // From two threads at once.
    let model = tiny(backend.clone());
    let handles: Vec<Model> = PROMPTS.iter().map(|_| model.share()).collect();
    assert!(handles.iter().all(|h| h.shares_weights_with(&model)));
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let threads: Vec<_> = handles
            .into_iter()
            .zip(PROMPTS)
            .map(|(handle, prompt)| s.spawn(move || generate(&mut session(handle), prompt)))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(got, expected, "two threads");

    // Interleaved step by step on one thread: every pass switches sessions.
    let mut sessions: Vec<Session> = PROMPTS.iter().map(|_| session(model.share())).collect();
    let mut next: Vec<u32> = sessions
        .iter_mut()
        .zip(PROMPTS)
        .map(|(s, p)| s.feed_greedy(p).unwrap())
        .collect();
    let mut got: Vec<Vec<u32>> = next.iter().map(|&id| vec![id]).collect();
    for _ in 1..STEPS {
        for (i, s) in sessions.iter_mut().enumerate() {
            next[i] = s.feed_greedy(&[next[i]]).unwrap();
            got[i].push(next[i]);
        }
    }
    assert_eq!(got, expected, "interleaved");
}

#[test]
fn sessions_on_one_model_give_the_tokens_of_separate_runs_on_the_cpu() {
    check_backend(Arc::new(CpuBackend::new(1)));
}

#[cfg(feature = "gpu")]
#[test]
fn sessions_on_one_model_give_the_tokens_of_separate_runs_on_wgpu() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    check_backend(Arc::new(ballast_runtime::WgpuBackend::new(ctx)));
}
