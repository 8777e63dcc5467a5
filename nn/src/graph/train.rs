//! Training on a graph: parameters and their optimizer state, gradients
//! for a data-parallel trainer, the optimizer step (fused into backward
//! where a layer can), a training step, prediction and the loss.

use super::{Graph, Node, Op, ParamState};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::Tensor;
use brgemm_primitives::loss::softmax_cross_entropy_rows;
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::Pool;

impl Graph {
    /// The layers with parameters, numbered in order of evaluation: the
    /// groups a data-parallel trainer reduces as backward completes them
    /// (the highest first).
    pub fn param_groups(&self) -> usize {
        self.groups.iter().flatten().count()
    }

    /// The layer of parameter group `g`.
    fn group_layer(&mut self, g: usize) -> Option<&mut Box<dyn Layer>> {
        let i = self.groups.iter().position(|x| *x == Some(g))?;
        match &mut self.nodes[i].op {
            Op::Layer(l) => Some(l),
            _ => None,
        }
    }

    /// The parameter buffers of group `g` (empty past the last group), in
    /// the layer's own layout.
    pub fn group_params_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.stale = true;
        self.group_layer(g)
            .map(|l| l.params().into_iter().map(|p| p.value).collect())
            .unwrap_or_default()
    }

    /// The gradient buffers of group `g`, as [`Graph::group_params_mut`].
    pub fn group_grads_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.group_layer(g)
            .map(|l| l.params().into_iter().map(|p| p.grad).collect())
            .unwrap_or_default()
    }

    /// Forward, softmax cross-entropy over the first `labels.len()` rows
    /// (the rest are padding: no loss, zero gradient), and backward without
    /// dL/d(input), calling `ready(group, grads)` as each parameter group
    /// completes (highest first): what a data-parallel trainer overlaps its
    /// all-reduce with. Returns the mean loss over the labelled rows; the
    /// optimizer step is left to the caller ([`Graph::step`]).
    pub fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        labels: &[usize],
        ready: &mut dyn FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32> {
        let logits = self.forward(pool, x, Mode::Train)?;
        let (loss, dlogits) = softmax_xent_rows(logits, labels)?;
        self.backward_from(pool, &dlogits, false, Some(ready), None)?;
        Ok(loss)
    }

    /// Every parameter with its gradient, in the order backward completes
    /// them (the last layer's first).
    pub fn params(&mut self) -> Vec<Param<'_>> {
        // The caller may change them: inference folds them again.
        self.stale = true;
        self.nodes
            .iter_mut()
            .rev()
            .filter_map(|n| match &mut n.op {
                Op::Layer(l) => Some(l.params()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// The optimizer's state per parameter, in [`Graph::params`] order:
    /// the step count and the moments (empty before the first step), the
    /// moments in the layout the layer exports its values in (PyTorch's),
    /// so that a checkpoint depends neither on this CPU's blocking nor on
    /// the minibatch.
    pub fn optimizer_state(&mut self) -> Result<Vec<ParamState>> {
        let mut out = Vec::new();
        for l in layers_by_params(&mut self.nodes) {
            for j in 0..l.params().len() {
                let (m, v, t) = self
                    .opt
                    .get(out.len())
                    .map_or((&[][..], &[][..], 0), OptState::parts);
                let m = nonempty(m, |b| as_exported(&mut **l, j, b))?;
                let v = nonempty(v, |b| as_exported(&mut **l, j, b))?;
                out.push((t, m, v));
            }
        }
        Ok(out)
    }

    /// Sets the optimizer's state from [`Graph::optimizer_state`] (of a graph
    /// of the same layers, any minibatch); a count or length that does not
    /// fit is an error naming the layer, and changes nothing.
    pub fn set_optimizer_state(&mut self, state: &[ParamState]) -> Result<()> {
        let mut states = Vec::with_capacity(state.len());
        let mut it = state.iter();
        for l in layers_by_params(&mut self.nodes) {
            for j in 0..l.params().len() {
                let (t, m, v) = it.next().ok_or_else(|| {
                    Error::Graph(format!(
                        "optimizer state: too few parameters for {}",
                        l.name()
                    ))
                })?;
                let m = nonempty(m, |b| from_exported(&mut **l, j, b))?;
                let v = nonempty(v, |b| from_exported(&mut **l, j, b))?;
                states.push(OptState::from_parts(m, v, *t));
            }
        }
        if it.next().is_some() {
            return Err(Error::Graph(format!(
                "optimizer state: {} parameters, the graph has {}",
                state.len(),
                states.len()
            )));
        }
        self.opt = states;
        Ok(())
    }

    /// One optimizer step on every parameter with the gradients of the last
    /// backward, on the calling thread. A bad hyper-parameter is an error
    /// naming it.
    pub fn step(&mut self, opt: &Optimizer) -> Result<()> {
        opt.validate()?;
        self.step_except(None, opt, &[]);
        Ok(())
    }

    /// [`Graph::step`] with each parameter's update split over `pool`'s
    /// threads (the training steps use it).
    pub fn step_with(&mut self, pool: &Pool, opt: &Optimizer) -> Result<()> {
        opt.validate()?;
        self.step_except(Some(pool), opt, &[]);
        Ok(())
    }

    /// The step on the parameters not marked in `done` (in
    /// [`Graph::params`] order; missing marks are false), on `pool` when
    /// given.
    fn step_except(&mut self, pool: Option<&Pool>, opt: &Optimizer, done: &[bool]) {
        // The caller may change them: inference folds them again.
        self.stale = true;
        let mut states = std::mem::take(&mut self.opt);
        let mut at = 0;
        // Layers in params order; a layer whose parameters were all stepped
        // is not asked for them (that would make it pack its bf16 weights
        // again, which its fused step already did).
        for n in self.nodes.iter_mut().rev() {
            let Op::Layer(l) = &mut n.op else { continue };
            let count = l.param_count();
            let skip = |j: usize| done.get(j).copied().unwrap_or(false);
            if (at..at + count).all(skip) {
                at += count;
                continue;
            }
            states.resize_with(states.len().max(at + count), OptState::default);
            for (j, p) in (at..).zip(l.params()) {
                if skip(j) {
                    continue;
                }
                match pool {
                    Some(pool) => states[j].step_on(pool, opt, p.value, p.grad),
                    None => states[j].step(opt, p.value, p.grad),
                }
            }
            at += count;
        }
        states.resize_with(states.len().max(at), OptState::default);
        self.opt = states;
    }

    /// Fused optimizer steps on or off (off by default). On,
    /// [`Graph::train_step`] steps the parameters of the layers that can
    /// ([`Layer::fuses_update`]: `Linear`) inside backward, each weight
    /// block from L1 as its gradient completes (`Fc::backward_weights_step`;
    /// in bf16, `FcBf16::backward_weights_step`, which also packs the next
    /// step's bf16 weights from the block), and the rest after; the weights
    /// end as the unfused step leaves them. Those layers' gradients are then
    /// not kept ([`Graph::params`] shows the previous ones), so this is for
    /// single-process training without a gradient check:
    /// [`Graph::compute_gradients_with`] (data-parallel, the finite guard)
    /// is unaffected and stays unfused.
    ///
    /// Each layer hears of it ([`Layer::plan_fused_update`]): a bf16
    /// linear layer may then run bf16 from fewer rows (the fused step packs
    /// its weights: `brgemm::Policy::avx512bf16_fc_min_rows_fused`). Where
    /// a layer's plan changes the optimizer's moments start afresh, as
    /// after [`Graph::set_bf16`]; best set before training. An error where
    /// a layer cannot be planned again (it keeps its plan).
    pub fn set_fused_update(&mut self, on: bool) -> Result<()> {
        self.fused_update = on;
        let mut planned = false;
        let mut told = Ok(());
        for n in &mut self.nodes {
            if let Op::Layer(l) = &mut n.op {
                match l.plan_fused_update(on) {
                    Ok(p) => planned |= p,
                    Err(e) => told = told.and(Err(e)),
                }
            }
        }
        if planned {
            self.opt.clear();
            self.stale = true;
            self.link_bf16();
        }
        told
    }

    /// One training step on a minibatch: forward, softmax cross-entropy
    /// against `labels` (one per sample, below the output's features),
    /// backward, optimizer step. Returns the mean loss; a non-finite loss is
    /// an error and leaves the weights as they were.
    pub fn train_step(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        labels: &[usize],
        opt: &Optimizer,
    ) -> Result<f32> {
        let n = self.input_shape().n;
        if labels.len() != n {
            return Err(Error::Graph(format!(
                "{} labels for a minibatch of {n}",
                labels.len()
            )));
        }
        self.train_step_rows(pool, x, labels, opt)
    }

    /// [`Graph::train_step`] on the first `labels.len()` rows of `x` (at
    /// most the minibatch; the rest are padding: no loss, zero gradient),
    /// as a short last minibatch of an epoch needs.
    pub fn train_step_rows(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        labels: &[usize],
        opt: &Optimizer,
    ) -> Result<f32> {
        let logits = self.forward(pool, x, Mode::Train)?;
        let (loss, dlogits) = softmax_xent_rows(logits, labels)?;
        if !loss.is_finite() {
            return Err(Error::Graph(format!(
                "loss is {loss}: weights left unchanged"
            )));
        }
        if self.fused_update {
            opt.validate()?;
            let stepped = self.backward_from(pool, &dlogits, false, None, Some(opt))?;
            self.step_except(Some(pool), opt, &stepped.1);
        } else {
            self.backward_from(pool, &dlogits, false, None, None)?;
            self.step_with(pool, opt)?;
        }
        Ok(loss)
    }

    /// The predicted class of each sample (arg max of the output).
    pub fn predict(&mut self, pool: &Pool, x: &Tensor) -> Result<Vec<usize>> {
        let y = self.forward(pool, x, Mode::Eval)?;
        let k = y.shape().features();
        Ok(y.data()
            .chunks_exact(k)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                    )
                    .0
            })
            .collect())
    }
}

/// The mean softmax cross-entropy of `logits` (`(n, classes, 1, 1)`) against
/// `labels`, and its gradient with respect to the logits.
pub fn softmax_cross_entropy(logits: &Tensor, labels: &[usize]) -> Result<(f32, Tensor)> {
    let s = logits.shape();
    if labels.len() != s.n {
        return Err(Error::Graph(format!(
            "{} labels for a minibatch of {}",
            labels.len(),
            s.n
        )));
    }
    softmax_xent_rows(logits, labels)
}

/// [`softmax_cross_entropy`] over the first `labels.len()` rows (at most
/// the minibatch): the mean over them, and a zero gradient for the rows
/// after them (padding of a data-parallel shard).
fn softmax_xent_rows(logits: &Tensor, labels: &[usize]) -> Result<(f32, Tensor)> {
    let s = logits.shape();
    let (k, rows) = (s.features(), labels.len());
    if rows == 0 || rows > s.n {
        return Err(Error::Graph(format!(
            "{rows} labels for a minibatch of {}",
            s.n
        )));
    }
    if let Some(&bad) = labels.iter().find(|&&l| l >= k) {
        return Err(Error::Graph(format!(
            "label {bad} is not below {k} classes"
        )));
    }
    let mut grad = Tensor::zeros(s);
    let loss = softmax_cross_entropy_rows(logits.data(), k, labels, grad.data_mut())?;
    Ok((loss, grad))
}

/// `buf` (laid out as parameter `j` of `l`) in the layout `l` exports that
/// parameter in: the layer's own conversion, run on `buf` in the
/// parameter's place. A layer exports its parameters first, in their order.
fn as_exported(l: &mut dyn Layer, j: usize, buf: &[f32]) -> Result<Vec<f32>> {
    let orig = swap_in(l, j, buf)?;
    let out = l.export().into_iter().nth(j).map(|(_, v)| v);
    swap_in(l, j, &orig)?;
    out.ok_or_else(|| Error::Graph(format!("{}: exports no value {j}", l.name())))
}

/// The inverse of [`as_exported`]: `plain` (as `l` exports parameter `j`)
/// in the parameter's own layout.
fn from_exported(l: &mut dyn Layer, j: usize, plain: &[f32]) -> Result<Vec<f32>> {
    let values: Vec<(String, Vec<f32>)> = l
        .export()
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
    match values.get(j) {
        Some((_, v)) if v.len() == plain.len() => {}
        _ => {
            return Err(Error::Graph(format!(
                "{}: optimizer state of {} values for parameter {j}",
                l.name(),
                plain.len()
            )))
        }
    }
    let mut edited = values.clone();
    edited[j].1 = plain.to_vec();
    l.import(&edited)?;
    let out = l.params()[j].value.to_vec();
    l.import(&values)?;
    Ok(out)
}

/// Puts `buf` in parameter `j`'s place; returns what was there.
fn swap_in(l: &mut dyn Layer, j: usize, buf: &[f32]) -> Result<Vec<f32>> {
    let mut ps = l.params();
    let p = ps
        .get_mut(j)
        .filter(|p| p.value.len() == buf.len())
        .ok_or_else(|| Error::Graph(format!("parameter {j} does not take {} values", buf.len())))?;
    let orig = p.value.to_vec();
    p.value.copy_from_slice(buf);
    Ok(orig)
}

/// The layers, in [`Graph::params`] order (the last layer first).
fn layers_by_params(nodes: &mut [Node]) -> impl Iterator<Item = &mut Box<dyn Layer>> {
    nodes.iter_mut().rev().filter_map(|n| match &mut n.op {
        Op::Layer(l) => Some(l),
        _ => None,
    })
}

/// `f(b)`, or nothing for an empty `b` (no step taken yet).
fn nonempty(b: &[f32], f: impl FnOnce(&[f32]) -> Result<Vec<f32>>) -> Result<Vec<f32>> {
    if b.is_empty() {
        Ok(Vec::new())
    } else {
        f(b)
    }
}
