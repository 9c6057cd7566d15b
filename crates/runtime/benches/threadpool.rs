//! The cost of one fork-join region of the thread pool: a decode step runs a couple of
//! hundred of them, so this must stay around a microsecond.

use ballast_runtime::threadpool::ThreadPool;
use criterion::{criterion_group, criterion_main, Criterion};

fn empty_region(c: &mut Criterion) {
    for n in [1, 2] {
        let pool = ThreadPool::new(n);
        c.bench_function(&format!("threadpool empty region, {n} threads"), |b| {
            b.iter(|| {
                pool.run(&|i, _| {
                    std::hint::black_box(i);
                })
            })
        });
    }
}

criterion_group!(benches, empty_region);
criterion_main!(benches);
