//! The loop-spec parser and interpreter: any spec string over any small
//! loop definitions is parsed to a nest or refused with an error; a nest
//! that parses visits every index of every loop exactly once.
#![no_main]

use brgemm_primitives::{LoopDef, LoopNest, Pool};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::{AtomicUsize, Ordering};

const NAMES: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];

fuzz_target!(|data: &[u8]| {
    // Byte 0: loop count; 4 bytes per loop (end, step, block, flags); the
    // rest is the spec string.
    let Some((&count, rest)) = data.split_first() else {
        return;
    };
    let count = (count % 9) as usize;
    let Some((defs, spec)) = (rest.len() >= 4 * count).then(|| rest.split_at(4 * count)) else {
        return;
    };
    let Ok(spec) = std::str::from_utf8(spec) else {
        return;
    };
    let loops: Vec<LoopDef> = defs
        .chunks_exact(4)
        .enumerate()
        .map(|(i, d)| {
            let mut l = LoopDef::new(NAMES[i], (d[0] % 24) as usize, (d[1] % 5) as usize);
            if d[2] != 0 {
                l = l.blocks(vec![(d[2] % 13) as usize]);
            }
            match d[3] % 3 {
                1 => l.reduction(),
                2 => l.ordered(),
                _ => l,
            }
        })
        .collect();
    let Ok(nest) = LoopNest::new(loops.clone(), spec) else {
        return;
    };
    // Every combination of indices runs once: count the body calls.
    let calls = AtomicUsize::new(0);
    static POOL: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| Pool::new(2).unwrap());
    nest.run(pool, |idx| {
        for (i, l) in loops.iter().enumerate() {
            assert!(idx[i] >= l.start && idx[i] < l.end, "index {idx:?} out of loop {i}");
        }
        calls.fetch_add(1, Ordering::Relaxed);
    });
    let want: usize = loops.iter().map(|l| l.trips()).product();
    assert_eq!(calls.into_inner(), want, "spec {spec:?}");
});
