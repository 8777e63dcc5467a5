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

mod train;
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

/// Builds a [`Graph`]: every node is added after its inputs, so the order
/// of addition is an order of evaluation.
pub struct GraphBuilder {
    nodes: Vec<Node>,
    fuse: bool,
}

impl GraphBuilder {
    /// A graph whose input has `shape` (minibatch included).
    pub fn new(shape: Shape) -> GraphBuilder {
        GraphBuilder {
            nodes: vec![Node::new(Op::Input, vec![], shape, None)],
            fuse: true,
        }
    }

    /// Whether [`GraphBuilder::build`] fuses layers where the data allow
    /// it (on by default): a ReLU that alone reads a batch norm's output
    /// runs inside the batch norm's pass ([`Layer::fuse_relu`]), one that
    /// alone reads a residual join inside the add's pass, and in
    /// inference a batch norm that alone reads a convolution's output is
    /// folded into its weights ([`Layer::fold_affine`]). Off gives the same
    /// results (to rounding) from separate passes, to measure the gain.
    pub fn fuse(mut self, on: bool) -> GraphBuilder {
        self.fuse = on;
        self
    }

    /// The input node.
    pub fn input(&self) -> NodeId {
        NodeId(0)
    }

    /// The output shape of `node`.
    pub fn shape(&self, node: NodeId) -> Shape {
        self.nodes[node.0].shape
    }

    fn check(&self, node: NodeId) -> Result<()> {
        if node.0 < self.nodes.len() {
            Ok(())
        } else {
            Err(Error::Graph(format!(
                "node {} is not in this graph",
                node.0
            )))
        }
    }

    /// Adds `layer` fed by `from`, planned for `from`'s output shape; a
    /// shape the layer cannot take is an error naming both.
    pub fn layer(&mut self, from: NodeId, mut layer: impl Layer + 'static) -> Result<NodeId> {
        self.check(from)?;
        layer.input_block(self.nodes[from.0].block);
        let shape = layer.build(self.shape(from))?;
        let block = layer.output_block();
        self.nodes.push(Node::new(
            Op::Layer(Box::new(layer)),
            vec![from.0],
            shape,
            block,
        ));
        Ok(NodeId(self.nodes.len() - 1))
    }

    /// Adds `a + b` (the residual join); their shapes must be equal.
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.check(a)?;
        self.check(b)?;
        let (left, right) = (self.shape(a), self.shape(b));
        if left != right {
            return Err(Error::Join {
                node: self.nodes.len(),
                left,
                right,
            });
        }
        let (ba, bb) = (self.nodes[a.0].block, self.nodes[b.0].block);
        let block = if ba == bb { ba } else { None };
        self.nodes
            .push(Node::new(Op::Add, vec![a.0, b.0], left, block));
        Ok(NodeId(self.nodes.len() - 1))
    }

    /// The graph computing `output`. Every node must contribute to it (a
    /// layer that does not would train on stale gradients).
    pub fn build(self, output: NodeId) -> Result<Graph> {
        self.check(output)?;
        let mut used = vec![false; self.nodes.len()];
        used[output.0] = true;
        for i in (0..=output.0).rev() {
            if used[i] {
                for &j in &self.nodes[i].inputs {
                    used[j] = true;
                }
            }
        }
        if let Some(i) = used.iter().position(|u| !u) {
            let what = match &self.nodes[i].op {
                Op::Layer(l) => l.name(),
                Op::Add => "add".into(),
                Op::Input => "input".into(),
            };
            return Err(Error::Graph(format!(
                "node {i} ({what}) does not reach the output node {}",
                output.0
            )));
        }
        let n = output.0 + 1;
        let mut nodes = self.nodes;
        nodes.truncate(n);
        if self.fuse {
            fuse_relus(&mut nodes);
            mark_foldable(&mut nodes);
            mark_joins(&mut nodes);
        }
        let mut count = 0;
        let groups = nodes
            .iter_mut()
            .map(|n| match &mut n.op {
                Op::Layer(l) => (!l.params().is_empty()).then(|| {
                    count += 1;
                    count - 1
                }),
                _ => None,
            })
            .collect();
        let mut g = Graph {
            groups,
            nodes,
            acts: vec![None; n],
            opt: Vec::new(),
            times: vec![[Duration::ZERO; 2]; n],
            stale: true,
            fused_update: false,
            handoff: true,
            handoffs: 0,
            bf16_alone: true,
            bf16_only: 0,
        };
        g.link_bf16();
        Ok(g)
    }
}

/// Lets a layer apply the ReLU that alone reads its output (batch norm
/// then ReLU: one pass over the tensor instead of two, each way).
fn fuse_relus(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        let j = nodes[i].inputs[0];
        let relu = matches!(&nodes[i].op, Op::Layer(l) if l.is_relu());
        if !relu || readers[j] != 1 || nodes[j].fused {
            continue;
        }
        match &mut nodes[j].op {
            Op::Layer(producer) => nodes[i].fused = producer.fuse_relu(),
            Op::Add => {
                nodes[j].relu = true;
                nodes[i].fused = true;
            }
            Op::Input => {}
        }
    }
}

/// Marks the affine layers (batch norm) whose input layer alone feeds
/// them: candidates for folding into that layer in inference.
fn mark_foldable(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        let j = nodes[i].inputs[0];
        let affine = matches!(&nodes[i].op, Op::Layer(l) if l.affine().is_some());
        let producer = matches!(nodes[j].op, Op::Layer(_));
        nodes[i].foldable = affine && producer && readers[j] == 1 && !nodes[i].fused;
    }
}

/// Marks the adds whose join the layer producing one input may do in its
/// output pass: that input read by the add alone, the other computed
/// before the layer runs.
fn mark_joins(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        if !matches!(nodes[i].op, Op::Add) {
            continue;
        }
        let (a, b) = (nodes[i].inputs[0], nodes[i].inputs[1]);
        let can = |p: usize, r: usize| {
            let n = &nodes[p];
            p != 0 && r < p && readers[p] == 1 && !n.fused && matches!(n.op, Op::Layer(_))
        };
        nodes[i].join = if can(a, b) {
            Some((a, b))
        } else if can(b, a) {
            Some((b, a))
        } else {
            None
        };
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

    /// Mixed precision on or off for every layer that has bf16 passes
    /// ([`Layer::set_bf16`]); returns how many run them. A layer that cannot
    /// is an error naming it (the layers before it are switched already).
    /// Layers may be planned again with other blocks, which reorders their
    /// parameters; the optimizer's moments start afresh, as after every
    /// change to the layers.
    pub fn set_bf16(&mut self, on: bool) -> Result<usize> {
        let mut n = 0;
        let set = self.layers_mut().try_for_each(|l| {
            n += usize::from(l.set_bf16(on)?);
            Ok::<_, Error>(())
        });
        self.link_bf16();
        set.map(|_| n)
    }

    /// Whether a layer whose output (or input gradient) a bf16 layer reads
    /// writes it in bf16 too, in its own pass (batch norm, and a bf16
    /// linear layer's forward), so that the reader runs no rounding sweep
    /// of its own and, without padding, reads it in place. On by default;
    /// the results are the same bits either way (both round to nearest
    /// even), off is for measuring what it saves.
    pub fn set_bf16_handoff(&mut self, on: bool) {
        self.handoff = on;
        self.link_bf16();
    }

    /// How many layers write bf16 copies for bf16 readers as the graph is
    /// planned now, an output and an input gradient counting one each.
    pub fn bf16_handoffs(&self) -> usize {
        self.handoffs
    }

    /// Whether a layer whose readers all take its output in bf16 alone
    /// writes only that, and a layer whose input gradient goes to a layer
    /// that reads it so writes only that ([`Layer::reads_bf16_only`],
    /// [`Layer::write_bf16_only`]): a bf16 convolution before its batch
    /// norm writes half the bytes, forward and backward (at stride 1),
    /// and the batch norm reads half. On by default. Unlike the copies of
    /// [`Graph::set_bf16_handoff`] it changes what the readers see: the
    /// batch norm normalises the convolution's output rounded to bf16, and
    /// its backward takes the gradient rounded (as PyTorch's autocast hands
    /// them over). Off keeps them f32.
    pub fn set_bf16_only_outputs(&mut self, on: bool) {
        self.bf16_alone = on;
        self.link_bf16();
    }

    /// How many outputs and input gradients layers write in bf16 alone, as
    /// the graph is planned now ([`Graph::set_bf16_only_outputs`]), an
    /// output and an input gradient counting one each.
    pub fn bf16_only_outputs(&self) -> usize {
        self.bf16_only
    }

    /// Tells each layer which bf16 copies its readers want
    /// ([`Layer::reads_bf16`], [`Layer::write_bf16`]): its output, where a
    /// reader takes bf16 input (through a fused ReLU, or an add the layer
    /// joins, its readers are theirs); its input gradient, where its sole
    /// input's sole reader is it and that input's layer reads its output
    /// gradient in bf16.
    fn link_bf16(&mut self) {
        let n = self.nodes.len();
        let mut readers = vec![0usize; n];
        for node in &self.nodes {
            node.inputs.iter().for_each(|&j| readers[j] += 1);
        }
        // The node whose pass writes node j's output.
        let writer = |mut j: usize| loop {
            match (&self.nodes[j].op, self.nodes[j].join) {
                _ if self.nodes[j].fused => j = self.nodes[j].inputs[0],
                (Op::Add, Some((p, _))) => j = p,
                _ => return j,
            }
        };
        let reads = |i: usize| match &self.nodes[i].op {
            Op::Layer(l) if !self.nodes[i].fused => l.reads_bf16(),
            _ => (false, false),
        };
        let mut out = vec![false; n];
        for i in 1..n {
            out[writer(self.nodes[i].inputs[0])] |= reads(i).0 && self.handoff;
        }
        // Node i, j's sole reader, writes j's output gradient (unless j
        // reads the graph's input: a training step skips its backward-data).
        let dx: Vec<bool> = (0..n)
            .map(|i| {
                let j = self.nodes[i].inputs.first().copied().unwrap_or(0);
                let sole = readers[j] == 1 && j != 0 && self.nodes[j].inputs[0] != 0;
                let layer = matches!(self.nodes[i].op, Op::Layer(_)) && !self.nodes[i].fused;
                sole && layer && reads(j).1 && self.handoff
            })
            .collect();
        // Node j's output in bf16 alone where every reader takes it so
        // (a batch norm after a bf16 convolution, a convolution updating in
        // bf16 after a batch norm): no reader joins it, and there is one
        // (not the graph's output).
        // A ReLU fused into j passes j's output on: its readers count as
        // j's (readers come after, so they are settled first).
        let mut only = vec![self.bf16_alone; n];
        only[0] = false;
        for i in (1..n).rev() {
            let node = &self.nodes[i];
            let takes = match &node.op {
                _ if node.fused => only[i] && readers[i] > 0,
                Op::Layer(l) => l.reads_bf16_only().0,
                _ => false,
            };
            node.inputs.iter().for_each(|&j| only[j] &= takes);
        }
        // Node i's input gradient in bf16 alone where the layer that
        // receives it (through fused ReLUs) reads it so and nothing else
        // (a bf16 convolution's dX for the batch norm before it, a batch
        // norm's dx for the bf16 convolution before it).
        let takes_dx = |mut j: usize| {
            while self.nodes[j].fused && readers[j] == 1 {
                j = self.nodes[j].inputs[0];
            }
            let node = &self.nodes[j];
            j != 0
                && readers[j] == 1
                && !node.fused
                && matches!(&node.op, Op::Layer(l) if l.reads_bf16_only().1)
        };
        let dx_only: Vec<bool> = (0..n)
            .map(|i| {
                let j = self.nodes[i].inputs.first().copied().unwrap_or(0);
                self.bf16_alone && i > 0 && !self.nodes[i].fused && takes_dx(j)
            })
            .collect();
        self.handoffs = 0;
        self.bf16_only = 0;
        for (i, node) in self.nodes.iter_mut().enumerate() {
            if let Op::Layer(l) = &mut node.op {
                // Values in bf16 alone need no bf16 copy besides.
                let (oa, da) = l.write_bf16_only(only[i] && readers[i] > 0, dx_only[i]);
                self.bf16_only += usize::from(oa) + usize::from(da);
                let (o, d) = l.write_bf16(out[i] && !oa, dx[i] && !da);
                self.handoffs += usize::from(o) + usize::from(d);
            }
        }
    }
}
