//! NHWC on the device, NCHW on the CPU: the conversions between the CPU
//! layers' layouts and the device's (images, convolution weights,
//! flattened activations).

use crate::device::Device;
use crate::error::{invalid, Result};
use crate::mlp::GpuDataset;

/// Uploads images given as rows of `c*h*w` features in NCHW order (the
/// CPU data sets') in the NHWC order the device layers read.
pub(crate) fn nhwc_dataset(
    dev: &Device,
    (c, h, w): (usize, usize, usize),
    x: &[f32],
    labels: &[usize],
) -> Result<GpuDataset> {
    let f = c * h * w;
    if x.len() != labels.len() * f {
        return Err(invalid(
            "images",
            x.len(),
            format!("needs {f} values per label"),
        ));
    }
    let nhwc: Vec<f32> = x
        .chunks(f)
        .flat_map(|img| (0..f).map(move |g| img[(g % c) * h * w + g / c]))
        .collect();
    GpuDataset::upload(dev, &nhwc, labels, f)
}

/// A CPU convolution's weights `[k][c][r][s]` in the device's order: tap
/// major, each tap `k x c` column-major.
pub(crate) fn taps_from_kcrs(kcrs: &[f32], k: usize, c: usize, taps: usize) -> Vec<f32> {
    let mut wt = vec![0.0f32; taps * k * c];
    for ko in 0..k {
        for ci in 0..c {
            for t in 0..taps {
                wt[t * k * c + ko + ci * k] = kcrs[(ko * c + ci) * taps + t];
            }
        }
    }
    wt
}

/// The inverse of [`taps_from_kcrs`].
pub(crate) fn kcrs_from_taps(wt: &[f32], k: usize, c: usize, taps: usize) -> Vec<f32> {
    let mut kcrs = vec![0.0f32; wt.len()];
    for ko in 0..k {
        for ci in 0..c {
            for t in 0..taps {
                kcrs[(ko * c + ci) * taps + t] = wt[t * k * c + ko + ci * k];
            }
        }
    }
    kcrs
}

/// The NHWC-to-NCHW map of a flattened `c x h x w` activation: device
/// feature g is CPU feature `perm[g]`.
pub(crate) fn nhwc_to_nchw(c: usize, h: usize, w: usize) -> Vec<usize> {
    (0..c * h * w).map(|g| (g % c) * h * w + g / c).collect()
}
