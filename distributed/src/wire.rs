//! What travels between ranks: gradients as f32 or bf16 ([`GradDtype`]),
//! the bf16 wire and its MPI reduction, and the flat buffers cut into
//! buckets.

use std::ops::Range;

/// How gradients travel between ranks ([`DataParallel::set_grad_dtype`](crate::DataParallel::set_grad_dtype)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradDtype {
    /// As computed: f32.
    #[default]
    F32,
    /// Rounded to bf16 (nearest even), summed in bf16 steps (each partial
    /// sum widened, added in f32, rounded again), widened at the end: half
    /// the bytes on the wire, 8 bits of mantissa in the sum.
    Bf16,
}

/// The MPI reduction of [`GradDtype::Bf16`]: `inout[i] = bf16(in[i] + inout[i])`
/// on bf16 bit patterns carried as 16-bit integers.
///
/// # Safety
/// MPI calls it with `invec` and `inoutvec` pointing at `*len` elements of
/// the datatype of the reduction, which [`DataParallel`](crate::DataParallel) makes `u16`
/// (`MPI_UNSIGNED_SHORT`) for every reduction it uses this operation in;
/// the two buffers do not overlap (MPI's contract for user operations).
pub(crate) unsafe extern "C" fn bf16_sum(
    invec: *mut std::ffi::c_void,
    inoutvec: *mut std::ffi::c_void,
    len: *mut std::ffi::c_int,
    _datatype: *mut mpi::ffi::MPI_Datatype,
) {
    let n = usize::try_from(*len).unwrap_or(0);
    let a = std::slice::from_raw_parts(invec as *const u16, n);
    let b = std::slice::from_raw_parts_mut(inoutvec as *mut u16, n);
    for (x, y) in a.iter().zip(b) {
        *y = to_bf16(widen(*x) + widen(*y));
    }
}

/// bf16 bits, rounded to nearest even (NaN kept).
pub(crate) fn to_bf16(v: f32) -> u16 {
    brgemm_primitives::fc_bf16::round_bf16(v).to_bits()
}

/// bf16 bits widened to f32 (exact).
pub(crate) fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// The bf16 wire: the gradients' bf16 copies, sent and received, and the
/// reduction that sums them.
pub(crate) struct Bf16Wire {
    pub(crate) send: Vec<u16>,
    pub(crate) recv: Vec<u16>,
    pub(crate) op: mpi::collective::UnsafeUserOperation,
}

impl Bf16Wire {
    pub(crate) fn new(n: usize) -> Bf16Wire {
        Bf16Wire {
            send: vec![0; n],
            recv: vec![0; n],
            // SAFETY: `bf16_sum` reads and writes `*len` u16 values, and this
            // operation reduces only the u16 buffers `send`/`recv`.
            op: unsafe { mpi::collective::UnsafeUserOperation::commutative(bf16_sum) },
        }
    }
}

/// `buf` cut into the buckets' slices (none when `buf` is empty: an unused
/// wire).
pub(crate) fn by_bucket<'a, T>(
    mut buf: &'a mut [T],
    buckets: &[Range<usize>],
) -> Vec<Option<&'a mut [T]>> {
    if buf.is_empty() {
        return Vec::new();
    }
    buckets
        .iter()
        .map(|b| {
            let (s, rest) = std::mem::take(&mut buf).split_at_mut(b.len());
            buf = rest;
            Some(s)
        })
        .collect()
}
