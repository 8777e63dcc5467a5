//! The layers: thin wrappers over the primitives' passes.

mod bidir;
mod conv2d;
mod linear;
mod norm_pool;
mod recurrent;
mod simple;

pub use bidir::Bidirectional;
pub use conv2d::{Conv2d, ConvGeometry};
pub use linear::Linear;
pub use norm_pool::{BatchNorm2d, Pool2dLayer};
pub use recurrent::Recurrent;
pub use simple::{Dropout, Flatten, GlobalAvgPool, Relu};

use crate::error::{Error, Result};
use crate::layer::Param;
use brgemm::bf16::bf16;
use brgemm::AlignedVec;

/// A layer's weights packed for its bf16 passes from the f32 masters: for
/// forward (`wv`) and for backward-data (`wtv`).
pub(crate) struct Bf16Operands {
    pub(crate) wv: AlignedVec<bf16>,
    pub(crate) wtv: AlignedVec<bf16>,
    /// Whether `wv`/`wtv` hold the current weights (reset whenever the
    /// parameters are handed out for writing).
    pub(crate) packed: bool,
}

impl Bf16Operands {
    pub(crate) fn new() -> Bf16Operands {
        let buf = || AlignedVec::new(brgemm::buffer::ALIGN);
        Bf16Operands {
            wv: buf(),
            wtv: buf(),
            packed: false,
        }
    }
}

/// A layer's weights and bias: plain, in PyTorch's order, until a graph
/// builds the layer; then inside its plan, in the primitive's layout.
pub(crate) enum State<P> {
    Plain(Vec<f32>, Vec<f32>),
    Built(P),
}

impl<P> State<P> {
    /// The plan, or the error naming the call made before any build.
    pub(crate) fn plan(&mut self, what: &str) -> Result<&mut P> {
        match self {
            State::Built(p) => Ok(p),
            State::Plain(..) => Err(unbuilt(what)),
        }
    }
    /// The plan when built.
    pub(crate) fn built(&self) -> Option<&P> {
        match self {
            State::Built(p) => Some(p),
            State::Plain(..) => None,
        }
    }
    /// Moves the state out (to rebuild), leaving empty plain values.
    pub(crate) fn take(&mut self) -> State<P> {
        std::mem::replace(self, State::Plain(Vec::new(), Vec::new()))
    }
}

/// The error of a call on a layer that no graph has built.
pub(crate) fn unbuilt(what: &str) -> Error {
    Error::Graph(format!(
        "{what} on a layer that was never built (add it to a graph)"
    ))
}

/// An error unless the last forward was a training one.
pub(crate) fn need_training(trained: bool, layer: &str) -> Result<()> {
    if trained {
        Ok(())
    } else {
        Err(Error::Graph(format!(
            "{layer}: backward without a training forward"
        )))
    }
}

/// The parameters of a layer with weights and a bias, in the order
/// backward completes them.
pub(crate) fn weight_and_bias<'a>(
    w: &'a mut [f32],
    dw: &'a mut [f32],
    b: &'a mut [f32],
    db: &'a mut [f32],
) -> Vec<Param<'a>> {
    vec![
        Param {
            name: "weight",
            value: w,
            grad: dw,
        },
        Param {
            name: "bias",
            value: b,
            grad: db,
        },
    ]
}

/// The values of an import, checked against the names `want` in order,
/// each with its length: an error names the layer and the first mismatch.
pub(crate) fn expect_values<'a>(
    layer: &str,
    values: &'a [(String, Vec<f32>)],
    want: &[(&str, usize)],
) -> Result<Vec<&'a [f32]>> {
    let names: Vec<&str> = values.iter().map(|(n, _)| n.as_str()).collect();
    let wanted: Vec<&str> = want.iter().map(|(n, _)| *n).collect();
    if names != wanted {
        return Err(Error::Graph(format!(
            "{layer}: values {names:?}, expected {wanted:?}"
        )));
    }
    values
        .iter()
        .zip(want)
        .map(|((name, v), (_, len))| {
            if v.len() == *len {
                Ok(&v[..])
            } else {
                Err(Error::Graph(format!(
                    "{layer}: {name} has {} values, expected {len}",
                    v.len()
                )))
            }
        })
        .collect()
}
