//! Sessions apart from the model: several sessions on one loaded model (handles from
//! `Model::share`), run one after another, interleaved, or from different threads, give
//! exactly the tokens of separate runs, and the weights are held once.

use std::sync::Arc;

use ballast_runtime::gguf::GgufFile;
use ballast_runtime::testing::{TinyModelSpec, TINY_VOCAB};
use ballast_runtime::{feed_batch, Backend, BatchFeed, CpuBackend, Model, Session};

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

    // Batched: one pass per step over both sessions, the prompts' lengths differing
    // (a pass of 7 + 4 rows, then 1 + 1).
    let mut batch_model = model.share();
    let mut sessions: Vec<Session> = PROMPTS.iter().map(|_| session(model.share())).collect();
    let mut inputs: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); PROMPTS.len()];
    for _ in 0..STEPS {
        let mut feeds: Vec<BatchFeed<'_>> = sessions
            .iter_mut()
            .zip(&inputs)
            .map(|(session, ids)| BatchFeed {
                session,
                ids,
                logits: true,
                scored: false,
            })
            .collect();
        feed_batch(&mut batch_model, &mut feeds).unwrap();
        for (i, s) in sessions.iter().enumerate() {
            let id = ballast_runtime::sampler::argmax(s.logits());
            got[i].push(id);
            inputs[i] = vec![id];
        }
    }
    assert_eq!(got, expected, "batched");
}

/// A session whose cache is a host [`DenseKv`] even where the backend keeps its own
/// caches on the device (a device pass then mirrors it).
#[cfg(feature = "gpu")]
fn host_cache_session(model: Model) -> Session {
    let kv = ballast_runtime::DenseKv::new(model.kv_shape(), 64);
    Session::with_cache(model, Box::new(kv), None)
}

/// A batched pass over sequences at different depths, some of them without logits,
/// writes each cache exactly what a pass of that sequence alone writes, and gives the
/// same logits, bit for bit. `make(i)` makes sequence i's session (host or device
/// cache).
fn check_batched_pass(model: &Model, make: &dyn Fn(usize, Model) -> Session) {
    // Histories of different lengths, then a mixed step: prompt chunks, single tokens,
    // a chunk whose logits are not wanted.
    let histories: [&[u32]; 6] = [
        &[5, 6, 7],
        &[200, 1, 2, 3, 4, 9],
        &[42],
        &[7, 7],
        &[100, 101, 102, 103],
        &[250],
    ];
    let step: [(&[u32], bool); 6] = [
        (&[8, 9, 10, 11], true),
        (&[12], true),
        (&[13, 14], false),
        (&[15], true),
        (&[16, 17, 18], true),
        (&[19], true),
    ];
    let mut alone: Vec<Session> = (0..6).map(|i| make(i, model.share())).collect();
    let mut batched: Vec<Session> = (0..6).map(|i| make(i, model.share())).collect();
    for ((a, b), h) in alone.iter_mut().zip(batched.iter_mut()).zip(histories) {
        a.feed(h).unwrap();
        b.feed(h).unwrap();
    }
    // The first sequence wants the logits after every token of its chunk (a
    // speculative verification), as `feed_scored` gives them alone; the fifth only the
    // last row's.
    let scored = |ids: &[u32], logits: bool| logits && ids.len() == 4;
    for (a, (ids, logits)) in alone.iter_mut().zip(step) {
        if scored(ids, logits) {
            a.feed_scored(ids).unwrap();
        } else {
            a.feed(ids).unwrap();
        }
    }
    let mut feeds: Vec<BatchFeed<'_>> = batched
        .iter_mut()
        .zip(step)
        .map(|(session, (ids, logits))| BatchFeed {
            session,
            ids,
            logits,
            scored: scored(ids, logits),
        })
        .collect();
    feed_batch(&mut model.share(), &mut feeds).unwrap();
    for (i, ((a, b), (ids, logits))) in alone.iter().zip(&batched).zip(step).enumerate() {
        assert_eq!(a.tokens(), b.tokens(), "sequence {i}: history");
        assert_eq!(a.kv().len(), b.kv().len(), "sequence {i}: cached tokens");
        for layer in 0..model.config().n_layers {
            let (va, vb) = (a.kv().view(layer), b.kv().view(layer));
            assert_eq!(
                format!("{va:?}"),
                format!("{vb:?}"),
                "sequence {i} layer {layer}"
            );
        }
        if logits {
            assert_eq!(a.logits(), b.logits(), "sequence {i}: logits");
        }
        if scored(ids, logits) {
            assert_eq!(a.scored(), b.scored(), "sequence {i}: every row's logits");
        }
    }
    // The next step of each batched sequence alone still matches: the caches (and on a
    // device, their mirrors) hold what they should.
    for (i, (a, b)) in alone.iter_mut().zip(batched.iter_mut()).enumerate() {
        let next = [(i as u32 * 31) % 250];
        let (la, lb) = (
            a.feed(&next).unwrap().to_vec(),
            b.feed(&next).unwrap().to_vec(),
        );
        assert_eq!(la, lb, "sequence {i}: the step after");
    }

    // A chunk that does not fit its cache is refused before anything runs.
    let mut small = Session::new(model.share(), 8).unwrap();
    let mut other = session(model.share());
    let mut feeds = vec![
        BatchFeed {
            session: &mut other,
            ids: &[1, 2],
            logits: true,
            scored: false,
        },
        BatchFeed {
            session: &mut small,
            ids: &[1; 9],
            logits: true,
            scored: false,
        },
    ];
    let err = feed_batch(&mut model.share(), &mut feeds).unwrap_err();
    assert!(err.to_string().contains('9'), "{err}");
    assert_eq!(other.kv().len(), 0, "nothing ran");
}

#[test]
fn a_batched_pass_equals_one_pass_per_sequence() {
    check_batched_pass(&tiny(Arc::new(CpuBackend::new(2))), &|_, m| session(m));
}

/// On wgpu the batched step is one device pass: sequences with device caches and with
/// host caches (mirrored; more of them than the backend keeps mirrors between passes)
/// side by side, each equal to a device pass of its own.
#[cfg(feature = "gpu")]
#[test]
fn a_batched_device_pass_equals_one_device_pass_per_sequence() {
    let Some(ctx) = ballast_runtime::testing::gpu_for_tests() else {
        return;
    };
    let model = tiny(Arc::new(ballast_runtime::WgpuBackend::new(ctx)));
    check_batched_pass(&model, &|i, m| {
        if i == 2 {
            session(m)
        } else {
            host_cache_session(m)
        }
    });
    check_batched_pass(&model, &|_, m| session(m));
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
