//! Generates the software-pipelined AVX-512 fp32 tiles (`avx512_pipe.rs` in
//! `OUT_DIR`, included by `src/kernels/avx512_f32.rs`).
//!
//! Why generated assembly: the pipelining is a register schedule. The k loop
//! keeps two sets of A registers (this k step's and the next one's, loaded a
//! whole step ahead) and a small ring of broadcast registers filled `R - 1`
//! columns ahead of the FMAs that read them. Written with intrinsics, LLVM
//! folds every broadcast back into its FMAs as an `{1to16}` memory operand,
//! which is the form this generator exists to avoid: on this VM an FMA that
//! waits on a load in the same uop runs 10-15% slower whenever the sibling
//! hyperthread is busy (see the module docs of `avx512_f32.rs`).
//!
//! One function per (MV, NR) with MV in 2..=4 and MV*NR + 2*MV + 2 <= 32.
//! The template is written once here; the functions differ only in counts and
//! register numbers, which are printed, not hand-copied.

use std::fmt::Write as _;
use std::path::PathBuf;

/// Largest NR per MV (index MV - 2) that leaves room for two A register sets
/// and a broadcast ring of at least two.
const PIPE_GRID: [usize; 3] = [12, 8, 5];

/// The same for the prefetching instances. Their three extra pointers do not
/// fit beside the six column-index registers of 2x12 (15 general registers;
/// debug builds keep rbp for the frame and have 14).
const PIPE_PF_GRID: [usize; 3] = [11, 8, 5];

/// Broadcast ring size: as large as the registers allow (capped at NR + 1
/// so the prologue stays inside the first k step), and dividing 2*NR so the
/// ring position of a column depends only on the parity of the k step, which
/// the two-step unrolled loop fixes.
fn ring(mv: usize, nr: usize) -> usize {
    let max = (32 - mv * nr - 2 * mv).min(nr + 1);
    (2..=max)
        .rev()
        .find(|&r| (2 * nr).is_multiple_of(r))
        .expect("R = 2 always divides 2*NR")
}

/// Memory operand of column `j` of B from base register `base`: column
/// offsets are j*bcol bytes, formed from the index registers c1, c3, ...
fn col(base: &str, j: usize) -> String {
    let idx = match j {
        0 => return format!("dword ptr [{{{base}}}]"),
        1 => "{c1}",
        2 => "{c1}*2",
        3 => "{c3}",
        4 => "{c1}*4",
        5 => "{c5}",
        6 => "{c3}*2",
        7 => "{c7}",
        8 => "{c1}*8",
        9 => "{c9}",
        10 => "{c5}*2",
        11 => "{c11}",
        _ => panic!("column {j} beyond the pipelined grid"),
    };
    format!("dword ptr [{{{base}}} + {idx}]")
}

/// Index registers (multiples of bcol) that columns 0..nr use.
fn index_regs(nr: usize) -> Vec<(usize, &'static str)> {
    [
        (1, "c1"),
        (3, "c3"),
        (5, "c5"),
        (7, "c7"),
        (9, "c9"),
        (11, "c11"),
    ]
    .into_iter()
    .filter(|&(mult, _)| match mult {
        1 => nr >= 2,
        m => nr > m,
    })
    .collect()
}

struct Regs {
    mv: usize,
    nr: usize,
    r: usize,
    /// First register of A set 0 (set 1 follows it).
    a0: usize,
    /// First register of the broadcast ring.
    br: usize,
}

impl Regs {
    fn new(mv: usize, nr: usize) -> Regs {
        let nacc = mv * nr;
        Regs {
            mv,
            nr,
            r: ring(mv, nr),
            a0: nacc,
            br: nacc + 2 * mv,
        }
    }
    fn a_set(&self, parity: usize) -> usize {
        self.a0 + parity * self.mv
    }
    /// Ring register of flattened position `t` (k step parity * NR + column).
    fn bc(&self, t: usize) -> usize {
        self.br + t % self.r
    }
    /// Loads the MV vectors of one A column (last one masked) into `set`.
    fn load_a(&self, out: &mut Vec<String>, set: usize, addr: &str) {
        for v in 0..self.mv {
            let mask = if v + 1 == self.mv {
                " {{{mk}}}{{z}}"
            } else {
                ""
            };
            out.push(format!(
                "vmovups zmm{}{mask}, zmmword ptr [{addr} + {}]",
                set + v,
                64 * v
            ));
        }
    }
    /// One k step. `parity` selects the A set and base register in use;
    /// `look` loads the next step's A and first broadcasts; `pf` adds the
    /// prefetches of the prefetching instances.
    fn step(&self, out: &mut Vec<String>, parity: usize, look: bool, pf: bool) {
        let d = self.r - 1;
        let (cur, nxt) = (self.a_set(parity), self.a_set(1 - parity));
        let (bcur, bnext) = if parity == 0 {
            ("b0", "b1")
        } else {
            ("b1", "b0")
        };
        if pf {
            // This column of the next pair's A, and one line of the ahead
            // region (the pointer stops at its end: `cmova` clamps it).
            for v in 0..self.mv {
                out.push(format!("prefetcht0 byte ptr [{{pa}} + {}]", 64 * v));
            }
            out.push("prefetcht0 byte ptr [{ah}]".into());
            out.push("add {ah}, 64".into());
            out.push("cmp {ah}, {ahe}".into());
            out.push("cmova {ah}, {ahe}".into());
            out.push("add {pa}, {lda}".into());
        }
        if look {
            self.load_a(out, nxt, "{ap} + {lda}");
        }
        for j in 0..self.nr {
            let t = j + d;
            if t < self.nr {
                out.push(format!(
                    "vbroadcastss zmm{}, {}",
                    self.bc(parity * self.nr + t),
                    col(bcur, t)
                ));
            } else if look {
                out.push(format!(
                    "vbroadcastss zmm{}, {}",
                    self.bc(parity * self.nr + t),
                    col(bnext, t - self.nr)
                ));
            }
            let b = self.bc(parity * self.nr + j);
            for v in 0..self.mv {
                out.push(format!(
                    "vfmadd231ps zmm{}, zmm{}, zmm{b}",
                    j * self.mv + v,
                    cur + v
                ));
            }
        }
    }
}

/// Which instance of a pipelined tile to print.
#[derive(Clone, Copy, PartialEq)]
enum Variant {
    /// No prefetching.
    Plain,
    /// Prefetches the next pair's A, and the ahead region or else the next
    /// pair's B (`Prefetch::NextPair`).
    Pf,
    /// As `Pf` without an ahead region, and the last pair walks the next
    /// call's first B (passed in `t.ahead`), as the others walk their
    /// successor's: `Kernel::execute_raw_then`.
    PfThen,
}

impl Variant {
    fn suffix(self) -> &'static str {
        match self {
            Variant::Plain => "",
            Variant::Pf => "_pf",
            Variant::PfThen => "_then",
        }
    }
}

fn tile_fn(mv: usize, nr: usize, variant: Variant) -> String {
    let pf = variant != Variant::Plain;
    let g = Regs::new(mv, nr);
    let d = g.r - 1;
    let mut asm = Vec::new();
    // Prologue: step 0's A and its first d broadcasts.
    g.load_a(&mut asm, g.a_set(0), "{ap}");
    for t in 0..d {
        asm.push(format!("vbroadcastss zmm{}, {}", g.bc(t), col("b0", t)));
    }
    let lines = |asm: &mut Vec<String>, l: &[&str]| asm.extend(l.iter().map(|x| x.to_string()));
    // Two k steps per trip (the A sets and B base registers alternate), then
    // the peeled last step, without lookahead, of whichever parity is left.
    lines(&mut asm, &["test {kk}, {kk}", "jz 4f", "2:"]);
    g.step(&mut asm, 0, true, pf);
    lines(
        &mut asm,
        &["add {ap}, {lda}", "add {b0}, {bs2}", "dec {kk}", "jz 5f"],
    );
    g.step(&mut asm, 1, true, pf);
    lines(
        &mut asm,
        &[
            "add {ap}, {lda}",
            "add {b1}, {bs2}",
            "dec {kk}",
            "jnz 2b",
            "4:",
        ],
    );
    g.step(&mut asm, 0, false, pf);
    lines(&mut asm, &["jmp 6f", "5:"]);
    g.step(&mut asm, 1, false, pf);
    lines(&mut asm, &["6:"]);

    let nacc = mv * nr;
    let mut s = String::new();
    writeln!(
        s,
        "/// The {mv}x{nr} tile, software-pipelined (ring of {r} broadcasts){pf_doc}.\n\
         ///\n\
         /// # Safety\n\
         /// AVX-512F available; as for [`crate::tile::tile`]. `t.k` may be 0.\n\
         #[target_feature(enable = \"avx512f\")]\n\
         #[allow(clippy::needless_range_loop)]\n\
         unsafe fn pipe{pf_name}_{mv}x{nr}<B: BatchSrc<f32>>(t: &TileCall, src: &B, m0: usize, n0: usize, last_rows: usize) {{\n\
         \x20   let mask = Avx512::mask(last_rows);\n\
         \x20   let boff = n0 * t.b_col;\n\
         \x20   let (lda, bs) = (t.lda * 4, t.b_step * 4);\n\
         {bc_line}\
         \x20   let mut acc = [[Avx512::zero(); {mv}]; {nr}];\n\
         \x20   if t.k > 0 {{\n\
         \x20       for i in 0..t.count {{\n\
         \x20           let a = src.a(i).add(m0);\n\
         \x20           let b = src.b(i).add(boff);\n\
         {pf_setup}\
         \x20           // SAFETY: reads k columns of A_i (MV vectors, the last\n\
         \x20           // masked) and k x NR elements of B_i, all inside the\n\
         \x20           // operands the caller vouched for; the lookahead loads\n\
         \x20           // stop at the last k step.\n\
         \x20           core::arch::asm!(",
        r = g.r,
        pf_doc = match variant {
            Variant::Plain => "",
            Variant::Pf => ", prefetching the next pair's A and the ahead region (else the next pair's B)",
            Variant::PfThen => ", prefetching the next pair's A and B, on the last pair the next call's first B",
        },
        pf_name = variant.suffix(),
        pf_setup = match variant {
            Variant::Plain => String::new(),
            Variant::Pf => PF_SETUP.replace("SPAN", &b_span(nr)),
            Variant::PfThen => PF_THEN_SETUP.replace("SPAN", &b_span(nr)),
        },
        bc_line = if nr > 1 { "    let bc = t.b_col * 4;\n" } else { "" },
    )
    .unwrap();
    for line in &asm {
        writeln!(s, "                \"{line}\",").unwrap();
    }
    writeln!(
        s,
        "                ap = inout(reg) a => _,\n\
         \x20               b0 = inout(reg) b => _,\n\
         \x20               b1 = inout(reg) b.wrapping_byte_add(bs) => _,\n\
         \x20               kk = inout(reg) t.k - 1 => _,\n\
         \x20               lda = in(reg) lda,\n\
         \x20               bs2 = in(reg) 2 * bs,\n\
         \x20               mk = in(kreg) mask,"
    )
    .unwrap();
    if pf {
        s.push_str("                pa = inout(reg) pa => _,\n                ah = inout(reg) ah => _,\n                ahe = in(reg) ahe,\n");
    }
    for (mult, name) in index_regs(nr) {
        let value = if mult == 1 {
            "bc".to_string()
        } else {
            format!("{mult} * bc")
        };
        writeln!(s, "                {name} = in(reg) {value},").unwrap();
    }
    for j in 0..nr {
        for v in 0..mv {
            writeln!(
                s,
                "                inout(\"zmm{}\") acc[{j}][{v}],",
                j * mv + v
            )
            .unwrap();
        }
    }
    for r in nacc..g.br + g.r {
        writeln!(s, "                out(\"zmm{r}\") _,").unwrap();
    }
    writeln!(
        s,
        "                options(nostack, readonly),\n\
         \x20           );\n\
         \x20       }}\n\
         \x20   }}\n\
         \x20   store_tile::<Avx512, {mv}, {nr}, true>(t, acc, m0, n0, mask, last_rows);\n\
         }}\n"
    )
    .unwrap();
    s
}

/// The elements from a tile's first B element to the end of its `nr`
/// columns' k steps, as an expression of the generated code.
fn b_span(nr: usize) -> String {
    match nr {
        1 => "t.k * t.b_step".into(),
        2 => "t.b_col + t.k * t.b_step".into(),
        _ => format!("{} * t.b_col + t.k * t.b_step", nr - 1),
    }
}

/// Per pair, in the prefetching tiles: where the next pair's A starts and
/// this (tile, pair)'s share of the ahead region, as in `tile::tile`. With no
/// share (no ahead region, or it is used up) the same line-per-step walk
/// covers the tile's columns of the next pair's B instead, so a B that
/// streams (a convolution's input rows) is prefetched too; on the last pair
/// both ends point at this pair's A (`pa`): prefetching it again costs
/// nothing.
const PF_SETUP: &str =
    "            let pa = src.a(if i + 1 < t.count { i + 1 } else { i }).add(m0);
            let a0 = t.ahead_next.get();
            let a1 = (a0 + t.ahead_per_pair).min(t.ahead_end);
            t.ahead_next.set(a1);
            let (ah, ahe) = if a1 > a0 {
                (t.ahead.wrapping_add(a0 * 16), t.ahead.wrapping_add(a1 * 16))
            } else if i + 1 < t.count {
                let pb = src.b(i + 1).add(boff);
                (pb, pb.wrapping_add(SPAN))
            } else {
                (pa, pa)
            };
";

/// The `PfThen` instances' setup per pair: the same walk as `PF_SETUP`'s
/// without an ahead region, over the next pair's B, and on the last pair over
/// the next call's (`t.ahead`: the plan runs these instances only for a call
/// that names one, and a prefetch never faults). A separate instance because
/// the extra branch in the tiles every f32 call shares measured 4-9 points of
/// peak on the 16-row FC passes.
const PF_THEN_SETUP: &str =
    "            let pa = src.a(if i + 1 < t.count { i + 1 } else { i }).add(m0);
            let pb = if i + 1 < t.count {
                src.b(i + 1).add(boff)
            } else {
                t.ahead.wrapping_add(boff)
            };
            let (ah, ahe) = (pb, pb.wrapping_add(SPAN));
";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let mut out =
        String::from("// @generated by brgemm/build.rs: the pipelined AVX-512 fp32 tiles.\n\n");
    let mut arms = String::new();
    for (i, &max_nr) in PIPE_GRID.iter().enumerate() {
        let mv = i + 2;
        for nr in 1..=max_nr {
            for (v, key) in [
                (Variant::Plain, "false, false"),
                (Variant::Pf, "true, false"),
                (Variant::PfThen, "true, true"),
            ] {
                if v != Variant::Plain && nr > PIPE_PF_GRID[i] {
                    continue;
                }
                out.push_str(&tile_fn(mv, nr, v));
                let name = v.suffix();
                writeln!(
                    arms,
                    "        ({mv}, {nr}, {key}) => Some(pipe{name}_{mv}x{nr}::<B> as TileFn<B>),"
                )
                .unwrap();
            }
        }
    }
    writeln!(
        out,
        "/// Largest NR per MV - 2 of the pipelined tiles.\n\
         pub(crate) const PIPE_GRID: [usize; 3] = {PIPE_GRID:?};\n\n\
         /// Largest NR per MV - 2 of the prefetching pipelined tiles.\n\
         pub(crate) const PIPE_PF_GRID: [usize; 3] = {PIPE_PF_GRID:?};\n\n\
         /// The pipelined `(mv, nr)` tile, prefetching or not, and walking the\n\
         /// next call's first B or not (`then`, prefetching only), if one is generated.\n\
         pub(crate) fn pipe_tile<B: BatchSrc<f32>>(mv: usize, nr: usize, prefetch: bool, then: bool) -> Option<TileFn<B>> {{\n\
         \x20   match (mv, nr, prefetch, then) {{\n{arms}        _ => None,\n    }}\n}}"
    )
    .unwrap();
    let path = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("avx512_pipe.rs");
    std::fs::write(path, out).unwrap();
}
