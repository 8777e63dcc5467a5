//! The MLP as a layer graph: one [`crate::Linear`] per layer, the
//! activation fused into each ([`mlp`], [`mlp_with_tunings`]).

use brgemm::Activation;
use brgemm_primitives::FcTuning;

/// One layer of an MLP ([`mlp`]): output features and activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Output features.
    pub out: usize,
    /// Activation.
    pub act: Activation,
}

impl LayerSpec {
    /// A classifier head: `hidden` ReLU layers, then `classes` logits
    /// (identity).
    pub fn classifier(hidden: &[usize], classes: usize) -> Vec<LayerSpec> {
        let relu = hidden.iter().map(|&out| LayerSpec {
            out,
            act: Activation::Relu,
        });
        relu.chain([LayerSpec {
            out: classes,
            act: Activation::Identity,
        }])
        .collect()
    }
}

/// The MLP of `specs` on the layer graph, for minibatch `batch` and
/// `inputs` features per sample: one [`crate::layers::Linear`] per spec (the
/// activation fused), weights drawn from `seed + layer` (He initialisation
/// for ReLU and GELU layers, Glorot for the others), zero biases. It trains
/// with the graph's loop, file and data-parallel replica, in mixed bf16
/// precision after [`crate::Graph::set_bf16`].
pub fn mlp(
    inputs: usize,
    batch: usize,
    specs: &[LayerSpec],
    seed: u64,
) -> crate::Result<crate::Graph> {
    mlp_with_tunings(inputs, batch, specs, seed, &[])
}

/// [`mlp`] with the blocking and loop orders of layer `i` from
/// `tunings[i]` (missing entries: the heuristic's).
pub fn mlp_with_tunings(
    inputs: usize,
    batch: usize,
    specs: &[LayerSpec],
    seed: u64,
    tunings: &[FcTuning],
) -> crate::Result<crate::Graph> {
    if specs.is_empty() {
        return Err(crate::Error::Graph(
            "an MLP needs at least one layer".into(),
        ));
    }
    let mut g = crate::GraphBuilder::new(crate::Shape::flat(batch, inputs));
    let mut x = g.input();
    let mut c = inputs;
    for (i, s) in specs.iter().enumerate() {
        let mut l = crate::layers::Linear::new(c, s.out, s.act, seed + i as u64);
        if let Some(t) = tunings.get(i) {
            l = l.with_tuning(t.clone());
        }
        x = g.layer(x, l)?;
        c = s.out;
    }
    g.build(x)
}
