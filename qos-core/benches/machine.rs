//! Cost of one state-machine tick: 8 GPUs × (1 online + N offline) processes.
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use qos_core::{Class, Config, GpuInput, Machine, ProcessObs, Share, Signal, MS};

fn inputs(n_offline: u32, now: u64, busy: bool) -> Vec<GpuInput<u32>> {
    (0..8)
        .map(|g| {
            let mut procs = vec![ProcessObs {
                key: g * 1000,
                class: Class::Online,
                last_active: busy.then_some(now),
                onset: None,
                signal: Signal::Nvml,
                share: Share::Burst,
            }];
            procs.extend((1..=n_offline).map(|i| ProcessObs {
                key: g * 1000 + i,
                class: Class::Offline,
                last_active: Some(now),
                onset: None,
                signal: Signal::Nvml,
                share: Share::Burst,
            }));
            GpuInput {
                gpu: g,
                procs,
                sampled_busy: false,
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for n in [1u32, 8, 64] {
        c.bench_function(&format!("tick_8gpus_{n}_offline_each"), |b| {
            let mut m = Machine::new(Config::default());
            let mut now = 1_000_000 * MS;
            b.iter(|| {
                now += MS;
                // Alternate busy/idle every 200 ms so both transitions are exercised.
                let busy = (now / (200 * MS)).is_multiple_of(2);
                black_box(m.tick(now, &inputs(n, now, busy)))
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
