//! Blocked 2-D layouts and conversions from and to the plain row-major
//! layouts users hold.
//!
//! A [`Blocked`] matrix of `rows x cols` is cut into `br x bc` blocks, stored
//! block-row by block-row (`[rows/br][cols/bc][..]`); inside a block the
//! elements are row-major (`[br][bc]`) or column-major (`[bc][br]`). Sizes that
//! are not multiples of the block are padded with zeros, and every primitive
//! keeps the padding at zero, so padding never changes a result.
//!
//! The FC layouts of the paper, in these terms:
//!
//! | tensor | layout | `Blocked` |
//! |---|---|---|
//! | activations X | `[N/bn][C/bc][bn][bc]` | rows N, cols C, row-major blocks |
//! | weights W | `[K/bk][C/bc][bc][bk]` | rows K, cols C, column-major blocks |
//! | output Y | `[N/bn][K/bk][bn][bk]` | rows N, cols K, row-major blocks |
//!
//! A row-major `[bn][bc]` block is a column-major `bc x bn` matrix, which is
//! what lets BRGEMM (column-major) read every block in place.

use crate::error::{check_buf, shape, Result};
use crate::threads::Pool;
use brgemm::aligned_vec;

/// Element order inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Inner {
    /// `[br][bc]`: columns contiguous.
    RowMajor,
    /// `[bc][br]`: rows contiguous.
    ColMajor,
}

/// Read accessors (`pub fn field(&self) -> T`) for private `Copy` fields:
/// plans and tensors expose their shape, never a field safe code could
/// change under a planned buffer.
macro_rules! getters {
    ($t:ty { $($field:ident: $ft:ty = $doc:literal),* $(,)? }) => {
        impl $t {
            $(
                #[doc = $doc]
                #[inline]
                pub fn $field(&self) -> $ft {
                    self.$field
                }
            )*
        }
    };
}
pub(crate) use getters;

/// A tensor type: private `Copy` shape fields with getters, and its
/// storage (`data`, sized by the constructors; f32 unless the element type
/// says otherwise) as slices: the length of the
/// buffer is fixed by the constructor, so safe code can change values but
/// never hand a pass a buffer shorter than its shape.
macro_rules! tensor_type {
    ($(#[$m:meta])* $name:ident { $($field:ident: $ft:ty = $doc:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name<T = f32> {
            $(pub(crate) $field: $ft,)*
            pub(crate) data: brgemm::AlignedVec<T>,
        }
        impl<T> $name<T> {
            $(
                #[doc = $doc]
                #[inline]
                pub fn $field(&self) -> $ft {
                    self.$field
                }
            )*
            /// The storage, padding included.
            #[inline]
            pub fn data(&self) -> &[T] {
                &self.data
            }
            /// The storage, padding included, to write values in place (its
            /// length is fixed). Writing non-zero values into the padding
            /// makes the padding no longer neutral; the plain setters never
            /// do.
            #[inline]
            pub fn data_mut(&mut self) -> &mut [T] {
                &mut self.data
            }
        }
    };
}
pub(crate) use tensor_type;

tensor_type! {
    /// A blocked, zero-padded matrix.
    ///
    /// Shape and storage are private: a `Blocked` is made only by its
    /// constructors, which size the buffer, so no safe call can hand a primitive
    /// a buffer shorter than the shape it declares.
    ///
    /// ```compile_fail
    /// use brgemm_primitives::{Blocked, Inner};
    /// let mut b = Blocked::zeros(4, 4, 2, 2, Inner::RowMajor).unwrap();
    /// b.rows = 1 << 20; // private: the shape cannot be changed under the buffer
    /// ```
    /// ```compile_fail
    /// use brgemm_primitives::{Blocked, Inner};
    /// let mut b = Blocked::zeros(4, 4, 2, 2, Inner::RowMajor).unwrap();
    /// b.data = brgemm::aligned_vec(1, 0.0); // private: no shorter buffer
    /// ```
    Blocked {
        rows: usize = "Logical rows.",
        cols: usize = "Logical columns.",
        br: usize = "Rows per block.",
        bc: usize = "Columns per block.",
        inner: Inner = "Order inside a block.",
    }
}

impl Blocked {
    /// A zero matrix.
    pub fn zeros(rows: usize, cols: usize, br: usize, bc: usize, inner: Inner) -> Result<Blocked> {
        Self::zeros_in(rows, cols, br, bc, inner, aligned_vec)
    }

    /// [`Blocked::zeros`] in a buffer made by `alloc(len, 0.0)`.
    fn zeros_in(
        rows: usize,
        cols: usize,
        br: usize,
        bc: usize,
        inner: Inner,
        alloc: fn(usize, f32) -> brgemm::AlignedVec<f32>,
    ) -> Result<Blocked> {
        for (what, v) in [
            ("rows", rows),
            ("cols", cols),
            ("block rows", br),
            ("block cols", bc),
        ] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        let len = rows
            .div_ceil(br)
            .checked_mul(cols.div_ceil(bc))
            .and_then(|x| x.checked_mul(br.checked_mul(bc)?))
            .ok_or_else(|| shape("rows x cols", format!("{rows}x{cols}"), "too large"))?;
        Ok(Blocked {
            rows,
            cols,
            br,
            bc,
            inner,
            data: alloc(len, 0.0),
        })
    }

    /// Blocks along the rows.
    pub fn row_blocks(&self) -> usize {
        self.rows.div_ceil(self.br)
    }
    /// Blocks along the columns.
    pub fn col_blocks(&self) -> usize {
        self.cols.div_ceil(self.bc)
    }
    /// Elements per block.
    pub fn block_len(&self) -> usize {
        self.br * self.bc
    }
    /// Offset of block `(i, j)`.
    #[inline]
    pub fn block(&self, i: usize, j: usize) -> usize {
        (i * self.col_blocks() + j) * self.block_len()
    }
    /// Offset of element `(r, c)`.
    #[inline]
    pub fn index(&self, r: usize, c: usize) -> usize {
        let (i, ri, j, ci) = (r / self.br, r % self.br, c / self.bc, c % self.bc);
        self.block(i, j)
            + match self.inner {
                Inner::RowMajor => ri * self.bc + ci,
                Inner::ColMajor => ci * self.br + ri,
            }
    }

    /// Row `r` as runs `(offset, len, step)`, columns 0.. in order: one run
    /// per column block, its elements `step` apart (1 in row-major blocks).
    /// The iterator does not borrow the matrix, so a caller may write
    /// through the runs as it walks them.
    pub fn row_runs(&self, r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let (i, ri) = (r / self.br, r % self.br);
        let (br, bc, cols, inner) = (self.br, self.bc, self.cols, self.inner);
        let (blocks, len) = (self.col_blocks(), self.block_len());
        (0..blocks).map(move |j| {
            let (base, n) = ((i * blocks + j) * len, bc.min(cols - j * bc));
            match inner {
                Inner::RowMajor => (base + ri * bc, n, 1),
                Inner::ColMajor => (base + ri, n, br),
            }
        })
    }

    /// The offsets of row `r`'s elements, columns 0.. in order: what
    /// [`Blocked::index`] gives for each, without its four divisions per
    /// element.
    pub fn row_offsets(&self, r: usize) -> impl Iterator<Item = usize> {
        self.row_runs(r)
            .flat_map(|(base, n, step)| (0..n).map(move |ci| base + ci * step))
    }

    /// Writes the logical row `r` from `src` (`cols` values).
    pub fn put_row(&mut self, r: usize, src: &[f32]) {
        let mut c = 0;
        for (off, n, step) in self.row_runs(r) {
            let src = &src[c..c + n];
            if step == 1 {
                self.data[off..off + n].copy_from_slice(src);
            } else {
                for (t, v) in src.iter().enumerate() {
                    self.data[off + t * step] = *v;
                }
            }
            c += n;
        }
    }

    /// Reads the logical row `r` into `dst` (`cols` values).
    pub fn get_row(&self, r: usize, dst: &mut [f32]) {
        let mut c = 0;
        for (off, n, step) in self.row_runs(r) {
            let dst = &mut dst[c..c + n];
            if step == 1 {
                dst.copy_from_slice(&self.data[off..off + n]);
            } else {
                for (t, v) in dst.iter_mut().enumerate() {
                    *v = self.data[off + t * step];
                }
            }
            c += n;
        }
    }

    /// Converts a plain row-major `rows x cols` matrix.
    pub fn from_plain(
        plain: &[f32],
        rows: usize,
        cols: usize,
        br: usize,
        bc: usize,
        inner: Inner,
    ) -> Result<Blocked> {
        let mut b = Blocked::zeros(rows, cols, br, bc, inner)?;
        b.set_plain(plain)?;
        Ok(b)
    }

    /// Overwrites the logical part from a plain row-major matrix.
    pub fn set_plain(&mut self, plain: &[f32]) -> Result<()> {
        check_buf("plain matrix", plain.len(), self.rows * self.cols)?;
        for (r, row) in plain.chunks_exact(self.cols).enumerate() {
            self.put_row(r, row);
        }
        Ok(())
    }

    /// The logical part as a plain row-major matrix.
    pub fn to_plain(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.get_row(r, row);
        }
        out
    }

    /// Writes this matrix's transpose into `t` (`cols x rows`), padding
    /// included. Blockwise when `t`'s blocks are this one's transposed (a
    /// copy per block if the inner order flips too, else a transpose per
    /// block); element by element otherwise.
    pub fn transpose_into(&self, t: &mut Blocked) -> Result<()> {
        if t.rows != self.cols || t.cols != self.rows {
            return Err(shape(
                "transpose target",
                format!("{}x{}", t.rows, t.cols),
                format!("must be {}x{}", self.cols, self.rows),
            ));
        }
        if t.br == self.bc && t.bc == self.br {
            let n = self.block_len();
            for i in 0..self.row_blocks() {
                for j in 0..self.col_blocks() {
                    let (s, d) = (self.block(i, j), t.block(j, i));
                    let (src, dst) = (&self.data[s..s + n], &mut t.data[d..d + n]);
                    if self.inner != t.inner {
                        dst.copy_from_slice(src);
                    } else {
                        let (r, c) = match self.inner {
                            Inner::RowMajor => (self.br, self.bc),
                            Inner::ColMajor => (self.bc, self.br),
                        };
                        transpose_block(src, dst, r, c);
                    }
                }
            }
            return Ok(());
        }
        for r in 0..self.rows {
            for c in 0..self.cols {
                let (i, j) = (t.index(c, r), self.index(r, c));
                t.data[i] = self.data[j];
            }
        }
        Ok(())
    }

    /// Writes the same matrix into `t`, which has the same blocking and the
    /// other inner order (a transpose inside each block).
    pub fn relayout_into(&self, t: &mut Blocked) -> Result<()> {
        if (t.rows, t.cols, t.br, t.bc) != (self.rows, self.cols, self.br, self.bc) {
            return Err(shape(
                "relayout target",
                format!("{}x{} in {}x{} blocks", t.rows, t.cols, t.br, t.bc),
                "must match the source's shape and blocking",
            ));
        }
        if t.inner == self.inner {
            t.data.copy_from_slice(&self.data);
            return Ok(());
        }
        let (r, c) = match self.inner {
            Inner::RowMajor => (self.br, self.bc),
            Inner::ColMajor => (self.bc, self.br),
        };
        for (src, dst) in self
            .data
            .chunks_exact(self.block_len())
            .zip(t.data.chunks_exact_mut(self.block_len()))
        {
            transpose_block(src, dst, r, c);
        }
        Ok(())
    }

    /// [`Blocked::transpose_into`] with the blockwise paths split over `pool`'s
    /// threads by block rows (each destination block is written by one thread).
    pub fn transpose_into_par(&self, t: &mut Blocked, pool: &Pool) -> Result<()> {
        if t.rows != self.cols
            || t.cols != self.rows
            || t.br != self.bc
            || t.bc != self.br
            || pool.threads() == 1
        {
            return self.transpose_into(t);
        }
        let n = self.block_len();
        let (rb, cb) = (self.row_blocks(), self.col_blocks());
        let flip = self.inner != t.inner;
        let (r, c) = match self.inner {
            Inner::RowMajor => (self.br, self.bc),
            Inner::ColMajor => (self.bc, self.br),
        };
        let dst = SyncPtr(t.data.as_mut_ptr());
        let t_ref = &*t;
        let t_blocks: Vec<usize> = (0..cb)
            .flat_map(|j| (0..rb).map(move |i| (j, i)))
            .map(|(j, i)| t_ref.block(j, i))
            .collect();
        pool.for_each(rb, |i| {
            for j in 0..cb {
                let s = self.block(i, j);
                let src = &self.data[s..s + n];
                // SAFETY: block (j, i) of `t` is written by the thread
                // that owns source block row i only.
                let d = unsafe {
                    std::slice::from_raw_parts_mut(dst.get().add(t_blocks[j * rb + i]), n)
                };
                if flip {
                    d.copy_from_slice(src);
                } else {
                    transpose_block(src, d, r, c);
                }
            }
        });
        Ok(())
    }

    /// [`Blocked::relayout_into`] split over `pool`'s threads by blocks.
    pub fn relayout_into_par(&self, t: &mut Blocked, pool: &Pool) -> Result<()> {
        if (t.rows, t.cols, t.br, t.bc) != (self.rows, self.cols, self.br, self.bc)
            || t.inner == self.inner
            || pool.threads() == 1
        {
            return self.relayout_into(t);
        }
        let n = self.block_len();
        let blocks = self.data.len() / n;
        let (r, c) = match self.inner {
            Inner::RowMajor => (self.br, self.bc),
            Inner::ColMajor => (self.bc, self.br),
        };
        let dst = SyncPtr(t.data.as_mut_ptr());
        pool.for_each(blocks, |b| {
            // SAFETY: each block is written by one thread.
            let d = unsafe { std::slice::from_raw_parts_mut(dst.get().add(b * n), n) };
            transpose_block(&self.data[b * n..(b + 1) * n], d, r, c);
        });
        Ok(())
    }

    /// Same blocking and shape (what a gradient buffer needs).
    pub fn same_shape(&self, o: &Blocked) -> bool {
        (self.rows, self.cols, self.br, self.bc, self.inner)
            == (o.rows, o.cols, o.br, o.bc, o.inner)
    }
}

/// `dst` (c x r, row-major) = transpose of `src` (r x c, row-major), in
/// 8x8 tiles so both sides stay in few cache lines: with AVX in registers
/// (8 row loads, 24 shuffles, 8 row stores per tile) when both sides are
/// multiples of 8, else element by element. The scalar loop moved about
/// 3 GB/s here, half the memory bandwidth, which made the weight transpose
/// of backward-data cost as much as the GEMM on a 4096x4096 layer at N = 64.
pub(crate) fn transpose_block(src: &[f32], dst: &mut [f32], r: usize, c: usize) {
    transpose_block_ld(src, dst, r, c, r)
}

/// [`transpose_block`] into rows `ld` floats apart (`ld >= r`): dst's row
/// j is `dst[j * ld..][..r]`.
pub(crate) fn transpose_block_ld(src: &[f32], dst: &mut [f32], r: usize, c: usize, ld: usize) {
    if r == 0 || c == 0 {
        return;
    }
    debug_assert!(ld >= r, "rows of {ld} cannot hold {r} values");
    let (src, dst) = (&src[..r * c], &mut dst[..(c - 1) * ld + r]);
    #[cfg(target_arch = "x86_64")]
    if r.is_multiple_of(8) && c.is_multiple_of(8) && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX checked just above; src holds r * c values and dst
        // (c - 1) * ld + r (sliced above); r, c are multiples of 8.
        unsafe { transpose_avx(src, dst, r, c, ld) };
        return;
    }
    const T: usize = 8;
    for i0 in (0..r).step_by(T) {
        for j0 in (0..c).step_by(T) {
            for i in i0..(i0 + T).min(r) {
                for j in j0..(j0 + T).min(c) {
                    dst[j * ld + i] = src[i * c + j];
                }
            }
        }
    }
}

/// The AVX 8x8-tile transpose of [`transpose_block`].
///
/// # Safety
/// The CPU has AVX; `src` holds at least `r * c` values and `dst`
/// `(c - 1) * ld + r`; `r` and `c` are multiples of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_avx(src: &[f32], dst: &mut [f32], r: usize, c: usize, ld: usize) {
    use std::arch::x86_64::*;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for i0 in (0..r).step_by(8) {
        for j0 in (0..c).step_by(8) {
            let row = |i: usize| _mm256_loadu_ps(sp.add((i0 + i) * c + j0));
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
            // Pairs of rows interleaved, then pairs of pairs, then the
            // 128-bit halves: column j of the tile ends up in t[j].
            let mix = |x, y| (_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
            let ((a0, a1), (a2, a3)) = (mix(r0, r1), mix(r2, r3));
            let ((a4, a5), (a6, a7)) = (mix(r4, r5), mix(r6, r7));
            const LO: i32 = 0b01_00_01_00;
            const HI: i32 = 0b11_10_11_10;
            // Each pair of pairs splits into its low and high halves.
            let halves = |x, y| (_mm256_shuffle_ps::<LO>(x, y), _mm256_shuffle_ps::<HI>(x, y));
            let ((b0, b1), (b2, b3)) = (halves(a0, a2), halves(a1, a3));
            let ((b4, b5), (b6, b7)) = (halves(a4, a6), halves(a5, a7));
            let t = [
                _mm256_permute2f128_ps::<0x20>(b0, b4),
                _mm256_permute2f128_ps::<0x20>(b1, b5),
                _mm256_permute2f128_ps::<0x20>(b2, b6),
                _mm256_permute2f128_ps::<0x20>(b3, b7),
                _mm256_permute2f128_ps::<0x31>(b0, b4),
                _mm256_permute2f128_ps::<0x31>(b1, b5),
                _mm256_permute2f128_ps::<0x31>(b2, b6),
                _mm256_permute2f128_ps::<0x31>(b3, b7),
            ];
            for (j, v) in t.into_iter().enumerate() {
                _mm256_storeu_ps(dp.add((j0 + j) * ld + i0), v);
            }
        }
    }
}

/// (rows, cols, block rows, block cols, inner order) of a blocked buffer:
/// what a primitive compares a buffer against on every call, allocating
/// nothing.
pub(crate) type Shape = (usize, usize, usize, usize, Inner);

impl Blocked {
    /// A zero buffer of a shape a plan validated (its size fits).
    pub(crate) fn zeros_of((rows, cols, br, bc, inner): Shape) -> Blocked {
        Blocked::zeros(rows, cols, br, bc, inner).expect("sizes checked when the layer was planned")
    }
    /// [`Blocked::zeros_of`] for weights and their gradients, which live as
    /// long as the layer: on huge pages ([`brgemm::buffer::aligned_vec_huge`];
    /// the FC passes that read a 64 MiB W 16 KiB at a time, 1 MiB apart,
    /// ran 4-18 points of peak faster so).
    pub(crate) fn weights_of((rows, cols, br, bc, inner): Shape) -> Blocked {
        let huge = brgemm::buffer::aligned_vec_huge::<f32>;
        Blocked::zeros_in(rows, cols, br, bc, inner, huge)
            .expect("sizes checked when the layer was planned")
    }
    /// This buffer's [`Shape`].
    pub(crate) fn shape(&self) -> Shape {
        (self.rows, self.cols, self.br, self.bc, self.inner)
    }
}

/// An error naming `what` unless `b` has the shape `want`.
pub(crate) fn check_shape(what: &str, b: &Blocked, want: Shape) -> crate::Result<()> {
    let (rows, cols, br, bc, inner) = want;
    if b.shape() != want {
        return Err(shape(
            what,
            format!(
                "{}x{} in {}x{} {:?} blocks",
                b.rows, b.cols, b.br, b.bc, b.inner
            ),
            format!("layer needs {rows}x{cols} in {br}x{bc} {inner:?} blocks"),
        ));
    }
    Ok(())
}

/// A raw pointer that may cross threads: each thread of a loop nest writes
/// only the blocks its indices own.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T = f32>(pub *mut T);
// SAFETY: used only to hand disjoint blocks to the threads of one nest.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer. A method, so closures capture the whole `SyncPtr`
    /// (edition-2021 closures would capture the bare field, which is not Sync).
    #[inline(always)]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_block_tiles_and_tails() {
        // 16x24 and 64x64 take the 8x8 AVX tiles where the CPU has AVX;
        // 13x8 and 8x5 the element loop; ld > r leaves the gaps alone.
        for (r, c) in [(16, 24), (64, 64), (13, 8), (8, 5), (1, 1)] {
            let src: Vec<f32> = (0..r * c).map(|i| i as f32).collect();
            for ld in [r, r + 3] {
                let mut dst = vec![f32::NAN; c * ld];
                transpose_block_ld(&src, &mut dst, r, c, ld);
                for j in 0..c {
                    for i in 0..ld {
                        let want = if i < r { src[i * c + j] } else { f32::NAN };
                        let got = dst[j * ld + i];
                        assert!(
                            got.to_bits() == want.to_bits(),
                            "{r}x{c}/{ld} at ({i}, {j})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn row_offsets_match_index() {
        for inner in [Inner::RowMajor, Inner::ColMajor] {
            let b = Blocked::zeros(13, 7, 4, 3, inner).unwrap();
            for r in 0..13 {
                let got: Vec<usize> = b.row_offsets(r).collect();
                let want: Vec<usize> = (0..7).map(|c| b.index(r, c)).collect();
                assert_eq!(got, want, "{inner:?} row {r}");
            }
        }
    }

    #[test]
    fn round_trip_with_padding_and_transpose() {
        let (r, c) = (13, 7);
        let plain: Vec<f32> = (0..r * c).map(|x| x as f32).collect();
        for inner in [Inner::RowMajor, Inner::ColMajor] {
            let b = Blocked::from_plain(&plain, r, c, 4, 3, inner).unwrap();
            assert_eq!(b.data.len(), 4 * 3 * 12);
            assert_eq!(b.to_plain(), plain);
            // Element-wise path, then both blockwise paths.
            for (tbr, tbc, tin) in [
                (2, 5, Inner::ColMajor),
                (3, 4, Inner::RowMajor),
                (3, 4, Inner::ColMajor),
            ] {
                let mut t = Blocked::zeros(c, r, tbr, tbc, tin).unwrap();
                b.transpose_into(&mut t).unwrap();
                let tp = t.to_plain();
                for i in 0..r {
                    for j in 0..c {
                        assert_eq!(tp[j * r + i], plain[i * c + j]);
                    }
                }
            }
            let other = if inner == Inner::RowMajor {
                Inner::ColMajor
            } else {
                Inner::RowMajor
            };
            let mut o = Blocked::zeros(r, c, 4, 3, other).unwrap();
            b.relayout_into(&mut o).unwrap();
            assert_eq!(o.to_plain(), plain);
            // The parallel paths give the same bytes.
            let pool = Pool::new(3).unwrap();
            let mut o2 = Blocked::zeros(r, c, 4, 3, other).unwrap();
            b.relayout_into_par(&mut o2, &pool).unwrap();
            assert_eq!(o2, o);
            for tin in [Inner::RowMajor, Inner::ColMajor] {
                let (mut t1, mut t2) = (
                    Blocked::zeros(c, r, 3, 4, tin).unwrap(),
                    Blocked::zeros(c, r, 3, 4, tin).unwrap(),
                );
                b.transpose_into(&mut t1).unwrap();
                b.transpose_into_par(&mut t2, &pool).unwrap();
                assert_eq!(t1, t2);
            }
        }
        assert!(Blocked::from_plain(&plain[1..], r, c, 4, 3, Inner::RowMajor).is_err());
    }
}
