//! The three batch forms, as callers pass them and as kernels read them.

use crate::error::{Error, Result};

/// A validated table of element offsets for the [`crate::BatchForm::Offset`] form.
///
/// Built once (typically when a primitive is planned) so that each call checks
/// slice lengths in O(1): the table keeps its largest offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offsets {
    a: Vec<usize>,
    b: Vec<usize>,
    max_a: usize,
    max_b: usize,
}

impl Offsets {
    /// Pairs `a[i]` (offset of A_i from the A base) with `b[i]`; both in elements.
    pub fn new(a: Vec<usize>, b: Vec<usize>) -> Result<Self> {
        if a.len() != b.len() {
            return Err(Error::BatchMismatch(format!(
                "offset tables differ in length: A has {}, B has {}",
                a.len(),
                b.len()
            )));
        }
        let max_a = a.iter().copied().max().unwrap_or(0);
        let max_b = b.iter().copied().max().unwrap_or(0);
        Ok(Offsets { a, b, max_a, max_b })
    }
    /// Batch size.
    pub fn len(&self) -> usize {
        self.a.len()
    }
    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.a.is_empty()
    }
    /// Offsets of the A_i.
    pub fn a(&self) -> &[usize] {
        &self.a
    }
    /// Offsets of the B_i.
    pub fn b(&self) -> &[usize] {
        &self.b
    }
    pub(crate) fn max_a(&self) -> usize {
        self.max_a
    }
    pub(crate) fn max_b(&self) -> usize {
        self.max_b
    }
}

/// The batch of a safe call, matching the descriptor's [`crate::BatchForm`].
#[derive(Debug, Clone, Copy)]
pub enum Batch<'a, T = f32> {
    /// `count` pairs at the descriptor's strides from the start of `a` and `b`.
    Stride {
        /// Holds A_0 .. A_{count-1}.
        a: &'a [T],
        /// Holds B_0 .. B_{count-1}.
        b: &'a [T],
        /// Batch size (may be 0).
        count: usize,
    },
    /// A_i = `a[offsets.a()[i]..]`, B_i = `b[offsets.b()[i]..]`.
    Offset {
        /// Base of every A_i.
        a: &'a [T],
        /// Base of every B_i.
        b: &'a [T],
        /// The offset table.
        offsets: &'a Offsets,
    },
    /// One slice per A_i and per B_i (an O(batch) length check per call).
    Address {
        /// The A_i.
        a: &'a [&'a [T]],
        /// The B_i.
        b: &'a [&'a [T]],
    },
}

/// The batch of a raw call: raw pointers, no checks.
#[derive(Debug, Clone, Copy)]
pub enum RawBatch<T = f32> {
    /// A_i = `a + i*stride_a`, B_i = `b + i*stride_b` (strides from the descriptor).
    Stride {
        /// A_0.
        a: *const T,
        /// B_0.
        b: *const T,
        /// Batch size.
        count: usize,
    },
    /// A_i = `a + a_offs[i]`, B_i = `b + b_offs[i]`.
    Offset {
        /// A base.
        a: *const T,
        /// B base.
        b: *const T,
        /// `count` element offsets into A.
        a_offs: *const usize,
        /// `count` element offsets into B.
        b_offs: *const usize,
        /// Batch size.
        count: usize,
    },
    /// A_i = `a[i]`, B_i = `b[i]`.
    Address {
        /// `count` pointers to the A_i.
        a: *const *const T,
        /// `count` pointers to the B_i.
        b: *const *const T,
        /// Batch size.
        count: usize,
    },
}

/// How a microkernel finds A_i and B_i: one implementation per batch form, so
/// each form gets its own fully specialised kernel.
pub(crate) trait BatchSrc<T>: Copy {
    /// # Safety
    /// `i` must be below the batch count the source was built with.
    unsafe fn a(&self, i: usize) -> *const T;
    /// # Safety
    /// As for [`BatchSrc::a`].
    unsafe fn b(&self, i: usize) -> *const T;
}

pub(crate) struct StrideSrc<T> {
    pub a: *const T,
    pub b: *const T,
    pub sa: usize,
    pub sb: usize,
}
impl<T> Clone for StrideSrc<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for StrideSrc<T> {}
impl<T> BatchSrc<T> for StrideSrc<T> {
    #[inline(always)]
    unsafe fn a(&self, i: usize) -> *const T {
        self.a.add(i * self.sa)
    }
    #[inline(always)]
    unsafe fn b(&self, i: usize) -> *const T {
        self.b.add(i * self.sb)
    }
}

pub(crate) struct OffsetSrc<T> {
    pub a: *const T,
    pub b: *const T,
    pub ao: *const usize,
    pub bo: *const usize,
}
impl<T> Clone for OffsetSrc<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OffsetSrc<T> {}
impl<T> BatchSrc<T> for OffsetSrc<T> {
    #[inline(always)]
    unsafe fn a(&self, i: usize) -> *const T {
        self.a.add(*self.ao.add(i))
    }
    #[inline(always)]
    unsafe fn b(&self, i: usize) -> *const T {
        self.b.add(*self.bo.add(i))
    }
}

pub(crate) struct AddrSrc<T> {
    pub a: *const *const T,
    pub b: *const *const T,
}
impl<T> Clone for AddrSrc<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for AddrSrc<T> {}
impl<T> BatchSrc<T> for AddrSrc<T> {
    #[inline(always)]
    unsafe fn a(&self, i: usize) -> *const T {
        *self.a.add(i)
    }
    #[inline(always)]
    unsafe fn b(&self, i: usize) -> *const T {
        *self.b.add(i)
    }
}
