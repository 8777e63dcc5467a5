//! The fragment layouts of `mma.sync.m16n8k16` (PTX ISA, "Matrix
//! Fragments for mma.m16n8k16 with floating point type"), written once.
//!
//! Lane `l` of a warp has group `g = l / 4` and thread-in-group
//! `tg = l % 4`. It holds, for a 16x16 A (row-major), 8 halves: slot `s`
//! is row `g + 8 ((s >> 1) & 1)`, column `2 tg + (s & 1) + 8 (s >> 2)`;
//! for a 16x8 B (column-major), 4 halves: slot `s` is row
//! `2 tg + (s & 1) + 8 (s >> 1)`, column `g`; for the 16x8 C, 4 floats:
//! slot `s` is row `g + 8 (s >> 1)`, column `2 tg + (s & 1)`.
//!
//! The CUDA kernel leaves A and B to `ldmatrix` and `mma` (the hardware
//! applies these layouts) and stores C through `FC_ROW`/`FC_COL`; the
//! OpenCL twin loads each lane's A and B slots through the same macros,
//! and its multiply-accumulate finds every element of a row of A and a
//! column of B in the lane and slot that the inverse macros name, through
//! local memory, as the tensor core does across the warp's registers. A
//! wrong layout therefore gives wrong sums on PoCL too
//! ([`set_fragment_fault`] plants one, for the test that shows it).

use std::sync::atomic::{AtomicU8, Ordering};

/// A deliberately wrong fragment layout, for the test that shows the
/// OpenCL twin catches one.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentFault {
    /// A's slots 0 and 1 (two columns of one row) swapped.
    SwapASlots,
    /// B's column taken from the thread-in-group instead of the group.
    BColumnFromTg,
}

static FAULT: AtomicU8 = AtomicU8::new(0);

/// Plants (or with None, removes) a fault in the layouts of every kernel
/// generated afterwards in this process; their names change with it, so no
/// cached kernel is reused. For tests only.
#[doc(hidden)]
pub fn set_fragment_fault(f: Option<FragmentFault>) {
    let v = match f {
        None => 0,
        Some(FragmentFault::SwapASlots) => 1,
        Some(FragmentFault::BColumnFromTg) => 2,
    };
    FAULT.store(v, Ordering::SeqCst);
}

/// The suffix that a planted fault adds to kernel names.
pub(crate) fn fault_suffix() -> &'static str {
    match FAULT.load(Ordering::SeqCst) {
        0 => "",
        1 => "_fault_a",
        _ => "_fault_b",
    }
}

/// The layouts as C macros over `g` and `tg` (in scope in the kernel):
/// `FA_ROW(s)`, `FA_K(s)`, `FB_K(s)`, `FB_COL(s)`, `FC_ROW(s)`, `FC_COL(s)`
/// give the element a lane holds in slot `s`; `FA_LANE(i, k)`,
/// `FA_SLOT(i, k)`, `FB_LANE(k, j)`, `FB_SLOT(k, j)` the lane and slot that
/// hold element (i, k) of A and (k, j) of B.
pub(crate) fn macros() -> String {
    let fault = FAULT.load(Ordering::SeqCst);
    // Slot s of A as stored; the fault swaps slots 0 and 1 (s ^ 1 for s < 2).
    let a_slot = if fault == 1 {
        "((s) < 2 ? (s) ^ 1 : (s))"
    } else {
        "(s)"
    };
    let b_col = if fault == 2 { "(tg)" } else { "(g)" };
    format!(
        "#define FA_ROW(s) (g + 8 * ((({a_slot}) >> 1) & 1))\n\
         #define FA_K(s) (2 * tg + (({a_slot}) & 1) + 8 * (({a_slot}) >> 2))\n\
         #define FA_LANE(i, k) ((((i) & 7) << 2) + (((k) & 7) >> 1))\n\
         #define FA_SLOT(i, k) (((k) & 1) + 2 * ((i) >> 3) + 4 * ((k) >> 3))\n\
         #define FB_K(s) (2 * tg + ((s) & 1) + 8 * ((s) >> 1))\n\
         #define FB_COL(s) {b_col}\n\
         #define FB_LANE(k, j) (((j) << 2) + (((k) & 7) >> 1))\n\
         #define FB_SLOT(k, j) (((k) & 1) + 2 * ((k) >> 3))\n\
         #define FC_ROW(s) (g + 8 * ((s) >> 1))\n\
         #define FC_COL(s) (2 * tg + ((s) & 1))\n"
    )
}

#[cfg(test)]
mod tests {
    /// The inverse maps name the lane and slot the forward maps put each
    /// element in: every element of A (16x16) and B (16x8) once.
    #[test]
    fn the_owners_invert_the_slots() {
        let mut a = [[None; 16]; 16];
        let mut b = [[None; 8]; 16];
        for lane in 0..32usize {
            let (g, tg) = (lane >> 2, lane & 3);
            for s in 0..8usize {
                let (i, k) = (g + 8 * ((s >> 1) & 1), 2 * tg + (s & 1) + 8 * (s >> 2));
                assert!(a[i][k].is_none());
                a[i][k] = Some((lane, s));
                let owner = (
                    ((i & 7) << 2) + ((k & 7) >> 1),
                    (k & 1) + 2 * (i >> 3) + 4 * (k >> 3),
                );
                assert_eq!(owner, (lane, s), "A ({i}, {k})");
            }
            for s in 0..4usize {
                let (k, j) = (2 * tg + (s & 1) + 8 * (s >> 1), g);
                assert!(b[k][j].is_none());
                b[k][j] = Some((lane, s));
                let owner = ((j << 2) + ((k & 7) >> 1), (k & 1) + 2 * (k >> 3));
                assert_eq!(owner, (lane, s), "B ({k}, {j})");
            }
        }
        assert!(a.iter().flatten().all(Option::is_some));
        assert!(b.iter().flatten().all(Option::is_some));
    }
}
