//! A network as a graph of layers: chains, and branches that join again by
//! addition (the residual shortcut, with or without a projection). Shapes
//! are checked as the graph is built; forward runs the nodes in the order
//! they were added, backward in reverse, summing the gradients of a node
//! that feeds several others.

use crate::error::{Error, Result};
use crate::layer::{Layer, Mode};
use crate::tensor::{add, relu_grad, Buf, Shape, Tensor};
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::Pool;
use std::time::{Duration, Instant};

/// A node of a graph under construction (or built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeId(usize);

/// One parameter's optimizer state as [`Graph::optimizer_state`] gives it:
/// the step count, then the first and second moments in the layer's export
/// layout (empty before the first step).
pub type ParamState = (u32, Vec<f32>, Vec<f32>);

mod bf16;
mod builder;
mod train;
pub use builder::GraphBuilder;
pub use train::softmax_cross_entropy;

enum Op {
    Input,
    Layer(Box<dyn Layer>),
    Add,
}

struct Node {
    op: Op,
    inputs: Vec<usize>,
    shape: Shape,
    /// The channel block its output travels in (None: plain).
    block: Option<usize>,
    /// A ReLU its input layer applies: forward and backward pass through.
    fused: bool,
    /// An add that applies the ReLU after it (which is then `fused`).
    relu: bool,
    /// An affine layer (batch norm) whose inference map its input layer
    /// may fold in: the layer at `inputs[0]`.
    foldable: bool,
    /// Folded now: inference forwards pass through.
    folded: bool,
    /// An add whose join a layer may do in its own pass
    /// ([`Layer::forward_add`]): the producer of one input, which this add
    /// alone reads, and the other input (the residual), computed before it.
    join: Option<(usize, usize)>,
    /// The last forward's join was done by a layer: this add passed its
    /// output through.
    joined: bool,
    /// The add's output; the sum of the gradients of a node feeding several.
    out: Buf,
    grad: Buf,
    /// The gradient through an add's fused ReLU.
    mask: Buf,
}

impl Node {
    fn new(op: Op, inputs: Vec<usize>, shape: Shape, block: Option<usize>) -> Node {
        Node {
            op,
            inputs,
            shape,
            block,
            fused: false,
            relu: false,
            foldable: false,
            folded: false,
            join: None,
            joined: false,
            out: Buf::default(),
            grad: Buf::default(),
            mask: Buf::default(),
        }
    }
}

/// A built network: forward, backward, and the optimizer step.
pub struct Graph {
    nodes: Vec<Node>,
    /// Each node's output of the last forward (not the input's).
    acts: Vec<Option<Tensor>>,
    opt: Vec<OptState>,
    /// Time spent in each node's forward and backward since the last
    /// [`Graph::reset_times`].
    times: Vec<[Duration; 2]>,
    /// Whether the folds of the affine layers may be out of date (weights
    /// or statistics changed since they were made).
    stale: bool,
    /// Each node's parameter group: the layers with parameters, numbered
    /// in order of evaluation.
    groups: Vec<Option<usize>>,
    /// [`Graph::train_step`] steps the layers that can inside backward.
    fused_update: bool,
    /// Layers write bf16 copies for the bf16 layers that read their
    /// outputs or input gradients ([`Graph::set_bf16_handoff`]), and how
    /// many such pairs there are now.
    handoff: bool,
    handoffs: usize,
    /// Layers write their output in bf16 alone where every reader takes
    /// it so ([`Graph::set_bf16_only_outputs`]), and how many do now.
    bf16_alone: bool,
    bf16_only: usize,
}

/// The callback of a backward that reports each parameter group's
/// gradients as they complete.
type Ready<'a> = &'a mut dyn FnMut(usize, &mut [&mut [f32]]);

/// Where a graph's time went, per node ([`Graph::times`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTime {
    /// The layer's name, or `add`.
    pub name: String,
    /// Forward FLOPs ([`Layer::flops`]).
    pub flops: f64,
    /// Seconds in forward (training and inference) since the last reset.
    pub forward_s: f64,
    /// Seconds in backward since the last reset.
    pub backward_s: f64,
}

/// What a node of a built graph is ([`Graph::topology`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// The graph's input.
    Input,
    /// A layer: [`Graph::layer`] reaches it by its type.
    Layer,
    /// The sum of its two inputs (a residual join).
    Add,
}

/// One node of a built graph, as another executor (a GPU's) walks it: in
/// order of evaluation, its inputs earlier nodes.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// The node, for [`Graph::layer`].
    pub id: NodeId,
    /// Input, layer or add.
    pub kind: NodeKind,
    /// The nodes it reads (indices into [`Graph::topology`]).
    pub inputs: Vec<usize>,
    /// Its output's shape.
    pub shape: Shape,
}

impl Graph {
    /// Every node in order of evaluation, with its inputs and output shape
    /// (fusion and folding left aside: each layer computes what its own
    /// definition says).
    pub fn topology(&self) -> Vec<NodeInfo> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| NodeInfo {
                id: NodeId(i),
                kind: match n.op {
                    Op::Input => NodeKind::Input,
                    Op::Layer(_) => NodeKind::Layer,
                    Op::Add => NodeKind::Add,
                },
                inputs: n.inputs.clone(),
                shape: n.shape,
            })
            .collect()
    }

    /// The input shape it was built for.
    pub fn input_shape(&self) -> Shape {
        self.nodes[0].shape
    }
    /// The output shape.
    pub fn output_shape(&self) -> Shape {
        self.nodes[self.nodes.len() - 1].shape
    }
    /// The layer at `node` as its own type `T` (None when the node is not
    /// a layer of that type): to reach a layer's own methods after the
    /// build, e.g. [`crate::Recurrent::final_state`].
    pub fn layer<T: Layer>(&self, node: NodeId) -> Option<&T> {
        match &self.nodes.get(node.0)?.op {
            Op::Layer(l) => (&**l as &dyn std::any::Any).downcast_ref(),
            _ => None,
        }
    }

    /// Every layer of type `T`, in order of evaluation (e.g. an MLP's
    /// [`crate::Linear`] layers, to read their weights).
    pub fn layers_of<T: Layer>(&self) -> Vec<&T> {
        self.layers()
            .filter_map(|l| (l as &dyn std::any::Any).downcast_ref())
            .collect()
    }

    /// [`Graph::layer`], to change.
    pub fn layer_mut<T: Layer>(&mut self, node: NodeId) -> Option<&mut T> {
        self.stale = true;
        match &mut self.nodes.get_mut(node.0)?.op {
            Op::Layer(l) => (&mut **l as &mut dyn std::any::Any).downcast_mut(),
            _ => None,
        }
    }

    /// The layers, in order of evaluation.
    pub(crate) fn layers(&self) -> impl Iterator<Item = &dyn Layer> {
        self.nodes.iter().filter_map(|n| match &n.op {
            Op::Layer(l) => Some(&**l),
            _ => None,
        })
    }

    /// The layers, to change, in order of evaluation; the optimizer state
    /// starts again (the values it followed are replaced).
    pub(crate) fn layers_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn Layer>> {
        self.opt.clear();
        self.stale = true;
        self.nodes.iter_mut().filter_map(|n| match &mut n.op {
            Op::Layer(l) => Some(l),
            _ => None,
        })
    }

    /// The layers' names, in order of evaluation.
    pub fn layer_names(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Layer(l) => Some(l.name()),
                _ => None,
            })
            .collect()
    }

    /// Each layer's name and forward FLOPs ([`Layer::flops`]), in order of
    /// evaluation.
    pub fn layer_flops(&self) -> Vec<(String, f64)> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Layer(l) => Some((l.name(), l.flops())),
                _ => None,
            })
            .collect()
    }

    /// The time each node took since the last [`Graph::reset_times`] (or
    /// the build), in order of evaluation: a per-layer profile at the cost
    /// of two clock reads per node and pass.
    pub fn times(&self) -> Vec<NodeTime> {
        // A layer that runs the ReLU after it says so.
        let mut fused_into = vec![false; self.nodes.len()];
        for n in self.nodes.iter().filter(|n| n.fused) {
            fused_into[n.inputs[0]] = true;
        }
        self.nodes[1..]
            .iter()
            .zip(&self.times[1..])
            .zip(&fused_into[1..])
            .map(|((n, t), &more)| {
                let (name, flops) = match &n.op {
                    Op::Layer(l) if n.fused => (format!("{} (fused)", l.name()), 0.0),
                    Op::Layer(l) if n.folded => (format!("{} (folded)", l.name()), 0.0),
                    Op::Layer(l) if more => (format!("{} + relu", l.name()), l.flops()),
                    Op::Layer(l) => (l.name(), l.flops()),
                    _ if n.relu && n.joined => ("add + relu (joined)".into(), 0.0),
                    _ if n.relu => ("add + relu".into(), 0.0),
                    _ if n.joined => ("add (joined)".into(), 0.0),
                    _ => ("add".into(), 0.0),
                };
                NodeTime {
                    name,
                    flops,
                    forward_s: t[0].as_secs_f64(),
                    backward_s: t[1].as_secs_f64(),
                }
            })
            .collect()
    }

    /// Starts [`Graph::times`] again from zero.
    pub fn reset_times(&mut self) {
        self.times.fill([Duration::ZERO; 2]);
    }

    /// Folds every foldable affine layer's current inference map into the
    /// layer before it (see [`GraphBuilder::fuse`]).
    fn refold(&mut self) {
        for i in 1..self.nodes.len() {
            if !self.nodes[i].foldable {
                continue;
            }
            let j = self.nodes[i].inputs[0];
            let affine = match &self.nodes[i].op {
                Op::Layer(l) => l.affine(),
                _ => None,
            };
            let done = match (&mut self.nodes[j].op, &affine) {
                (Op::Layer(l), Some(a)) => l.fold_affine(Some(a)),
                _ => false,
            };
            self.nodes[i].folded = done;
        }
        self.stale = false;
    }

    /// The output for `x`; in [`Mode::Train`] every layer keeps what its
    /// backward needs.
    pub fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<&Tensor> {
        x.expect("graph input", self.input_shape())?;
        match mode {
            // Batch statistics move the running ones.
            Mode::Train => self.stale = true,
            Mode::Eval if self.stale => self.refold(),
            Mode::Eval => {}
        }
        // The last step's outputs go first, so that the layers can write
        // their buffers again in place (a fused node's output is its
        // producer's buffer).
        self.acts.fill(None);
        let joins = self.joiners(mode);
        for (i, join) in joins.into_iter().enumerate().skip(1) {
            let (acts, node) = (&self.acts, &mut self.nodes[i]);
            // The graph's input is read in place, not copied into `acts`.
            let act = |j: usize| match j {
                0 => x,
                j => acts[j].as_ref().expect("inputs run first"),
            };
            let input = |k: usize| act(node.inputs[k]);
            let start = Instant::now();
            let out = match &mut node.op {
                _ if node.fused => input(0).clone(),
                _ if node.folded && mode == Mode::Eval => input(0).clone(),
                Op::Layer(l) => match join {
                    Some((a, r, relu)) => {
                        match l.forward_add(pool, input(0), act(r), relu, mode)? {
                            Some(y) => {
                                self.nodes[a].joined = true;
                                y
                            }
                            None => l.forward(pool, input(0), mode)?,
                        }
                    }
                    None => l.forward(pool, input(0), mode)?,
                },
                Op::Add if node.joined => {
                    let (p, _) = node.join.expect("joined adds have one");
                    act(p).clone()
                }
                Op::Add => add(pool, input(0), input(1), &mut node.out, node.relu)?,
                Op::Input => unreachable!("only node 0 is the input"),
            };
            self.times[i][0] += start.elapsed();
            self.acts[i] = Some(out);
        }
        Ok(self.acts[self.nodes.len() - 1].as_ref().expect("ran"))
    }

    /// Per node, the add (index, residual, ReLU) whose join it tries in a
    /// forward in `mode`: the add's producer, or in inference the layer a
    /// folded producer passes through (when the residual runs before it).
    /// Every add starts the forward not joined.
    fn joiners(&mut self, mode: Mode) -> Vec<Option<(usize, usize, bool)>> {
        let mut joins = vec![None; self.nodes.len()];
        for a in 1..self.nodes.len() {
            self.nodes[a].joined = false;
            let Some((p, r)) = self.nodes[a].join else {
                continue;
            };
            let at = if mode == Mode::Eval && self.nodes[p].folded {
                let c = self.nodes[p].inputs[0];
                (r < c).then_some(c)
            } else {
                Some(p)
            };
            if let Some(at) = at {
                joins[at] = Some((a, r, self.nodes[a].relu));
            }
        }
        joins
    }

    /// dL/d(input) for dL/d(output) `dy` of the last training forward;
    /// every layer's parameter gradients are written.
    pub fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        self.backward_from(pool, dy, true, None, None)
            .map(|dx| dx.0.expect("asked for"))
    }

    /// Backward; dL/d(input) only when `input` (a training step skips the
    /// backward-data passes of the layers that read the graph's input).
    /// `ready(group, grads)` is called as each layer with parameters
    /// completes its gradients (see [`Graph::param_groups`]). With `fuse`,
    /// the layers that can step their parameters with that optimizer as
    /// the gradients complete ([`Layer::backward_step`]); the second result
    /// marks them, in [`Graph::params`] order.
    fn backward_from(
        &mut self,
        pool: &Pool,
        dy: &Tensor,
        input: bool,
        mut ready: Option<Ready<'_>>,
        fuse: Option<&Optimizer>,
    ) -> Result<(Option<Tensor>, Vec<bool>)> {
        // Each node's parameters: how many, and from where in params order
        // (last node first).
        let (mut first, mut stepped, mut states) = (vec![0; self.nodes.len()], vec![], vec![]);
        if fuse.is_some() {
            let counts: Vec<usize> = (self.nodes.iter_mut())
                .map(|n| match &mut n.op {
                    Op::Layer(l) => l.param_count(),
                    _ => 0,
                })
                .collect();
            let mut at = 0;
            for i in (0..counts.len()).rev() {
                first[i] = at;
                at += counts[i];
            }
            stepped = vec![false; at];
            states = std::mem::take(&mut self.opt);
            states.resize_with(at, OptState::default);
        }
        let out = self.backward_nodes(
            pool,
            dy,
            input,
            &mut ready,
            fuse,
            &first,
            &mut stepped,
            &mut states,
        );
        if fuse.is_some() {
            self.opt = states;
        }
        Ok((out?, stepped))
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_nodes(
        &mut self,
        pool: &Pool,
        dy: &Tensor,
        input: bool,
        ready: &mut Option<Ready<'_>>,
        fuse: Option<&Optimizer>,
        first: &[usize],
        stepped: &mut [bool],
        states: &mut [OptState],
    ) -> Result<Option<Tensor>> {
        dy.expect("output gradient", self.output_shape())?;
        if self.acts[1..].iter().any(Option::is_none) {
            return Err(Error::Graph("backward before any forward".into()));
        }
        let n = self.nodes.len();
        let mut grads: Vec<Option<Tensor>> = vec![None; n];
        grads[n - 1] = Some(dy.clone());
        for i in (1..n).rev() {
            let g = grads[i].take().expect("every node reaches the output");
            let start = Instant::now();
            let node = &mut self.nodes[i];
            let outs: Vec<(usize, Tensor)> = match &mut node.op {
                _ if node.fused => vec![(node.inputs[0], g)],
                Op::Layer(l) if fuse.is_some() && l.fuses_update() => {
                    let want = node.inputs[0] != 0 || input;
                    let n = l.param_count();
                    let opt = fuse.expect("checked");
                    let dx =
                        l.backward_step(pool, &g, want, opt, &mut states[first[i]..first[i] + n])?;
                    stepped[first[i]..first[i] + n].fill(true);
                    dx.map(|d| vec![(node.inputs[0], d)]).unwrap_or_default()
                }
                Op::Layer(l) if node.inputs[0] == 0 && !input => {
                    l.backward_params(pool, &g)?;
                    vec![]
                }
                Op::Layer(l) => vec![(node.inputs[0], l.backward(pool, &g)?)],
                Op::Add => {
                    let g = if node.relu {
                        let y = self.acts[i].as_ref().expect("checked above");
                        relu_grad(pool, &g, y, &mut node.mask)?
                    } else {
                        g
                    };
                    vec![(node.inputs[0], g.clone()), (node.inputs[1], g)]
                }
                Op::Input => unreachable!("only node 0 is the input"),
            };
            self.times[i][1] += start.elapsed();
            if let (Some(ready), Some(group)) = (ready.as_mut(), self.groups[i]) {
                if let Op::Layer(l) = &mut self.nodes[i].op {
                    let mut grads: Vec<&mut [f32]> =
                        l.params().into_iter().map(|p| p.grad).collect();
                    ready(group, &mut grads);
                }
            }
            for (j, d) in outs {
                if j == 0 && !input {
                    continue;
                }
                grads[j] = Some(match grads[j].take() {
                    Some(acc) => add(pool, &acc, &d, &mut self.nodes[j].grad, false)?,
                    None => d,
                });
            }
        }
        Ok(grads[0].take())
    }
}
