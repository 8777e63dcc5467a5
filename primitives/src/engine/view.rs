//! Typed addressing of a tensor's blocks. A loop body takes its operands'
//! pointers from block indices (`x.at([nb, cb])`) instead of repeating each
//! layout's offset algebra; the strides come from the tensor's shape, which
//! the pass checked at its entry.
//!
//! Pointers are formed with wrapping arithmetic, so computing one is safe;
//! reading or writing through it is the caller's `unsafe`, justified by
//! that check (and, for [`ViewMut`], by the nest giving each output block
//! to one thread).

use crate::layout::Blocked;

/// Read-only addressing: the element offset of block `idx` is `idx . strides`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<const D: usize, T = f32> {
    base: *const T,
    strides: [usize; D],
}

/// Writable addressing, as [`View`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ViewMut<const D: usize, T = f32> {
    base: *mut T,
    strides: [usize; D],
}

// SAFETY: views only compute addresses; the passes that dereference them
// hand disjoint output blocks to the threads of a nest.
unsafe impl<const D: usize, T> Send for View<D, T> {}
unsafe impl<const D: usize, T> Sync for View<D, T> {}
unsafe impl<const D: usize, T> Send for ViewMut<D, T> {}
unsafe impl<const D: usize, T> Sync for ViewMut<D, T> {}

#[inline(always)]
fn offset<const D: usize>(idx: [usize; D], strides: [usize; D]) -> usize {
    let mut off = 0;
    for d in 0..D {
        off += idx[d] * strides[d];
    }
    off
}

impl<const D: usize, T> View<D, T> {
    /// A view of raw storage (a pass's scratch) with these strides.
    pub(crate) fn new(data: &[T], strides: [usize; D]) -> Self {
        View {
            base: data.as_ptr(),
            strides,
        }
    }
    /// The first element of block `idx`.
    #[inline(always)]
    pub(crate) fn at(self, idx: [usize; D]) -> *const T {
        self.base.wrapping_add(offset(idx, self.strides))
    }
}

impl<const D: usize, T> ViewMut<D, T> {
    /// A writable view of raw storage with these strides.
    pub(crate) fn new(data: &mut [T], strides: [usize; D]) -> Self {
        ViewMut {
            base: data.as_mut_ptr(),
            strides,
        }
    }
    /// A writable view from a raw pointer (a thread's partial sums).
    pub(crate) fn from_ptr(base: *mut T, strides: [usize; D]) -> Self {
        ViewMut { base, strides }
    }
    /// The first element of block `idx`.
    #[inline(always)]
    pub(crate) fn at(self, idx: [usize; D]) -> *mut T {
        self.base.wrapping_add(offset(idx, self.strides))
    }
    /// The `len` elements from block `idx` on.
    ///
    /// # Safety
    /// They must lie inside the viewed storage and no other live reference
    /// may overlap them.
    #[inline(always)]
    pub(crate) unsafe fn slice<'a>(self, idx: [usize; D], len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.at(idx), len)
    }
}

impl Blocked {
    fn block_strides(&self) -> [usize; 2] {
        [self.col_blocks() * self.block_len(), self.block_len()]
    }
    /// Blocks by `[row block, column block]`.
    pub(crate) fn blocks(&self) -> View<2> {
        View::new(&self.data, self.block_strides())
    }
    /// Writable blocks by `[row block, column block]`.
    pub(crate) fn blocks_mut(&mut self) -> ViewMut<2> {
        let s = self.block_strides();
        ViewMut::new(&mut self.data, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Inner;

    #[test]
    fn views_address_what_the_index_methods_do() {
        let b = Blocked::zeros(10, 7, 4, 3, Inner::RowMajor).unwrap();
        let base = b.data().as_ptr();
        for (i, j) in [(0, 0), (1, 2), (2, 1)] {
            assert_eq!(b.blocks().at([i, j]), base.wrapping_add(b.block(i, j)));
        }
    }
}
