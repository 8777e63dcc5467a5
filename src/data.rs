//! Data sets for the examples and tests.
//!
//! [`digits`] is embedded in the crate: the UCI "Optical Recognition of
//! Handwritten Digits" data (1797 images of 8x8 pixels, 0..16), by E. Alpaydin
//! and C. Kaynak (1998), UCI Machine Learning Repository, CC BY 4.0.

use brgemm_primitives::init::Rng;
use brgemm_primitives::Blocked;
use std::io::Read;

static DIGITS_CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// Images as rows of features in [0, 1], with class labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Features per image.
    pub features: usize,
    /// Number of classes.
    pub classes: usize,
    /// `len * features` values, image-major.
    pub x: Vec<f32>,
    /// One label per image.
    pub y: Vec<usize>,
}

impl Dataset {
    /// Images.
    pub fn len(&self) -> usize {
        self.y.len()
    }
    /// Whether there are no images.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
    /// The images at `idx`, in that order.
    pub fn subset(&self, idx: &[usize]) -> Dataset {
        let f = self.features;
        Dataset {
            features: f,
            classes: self.classes,
            x: idx
                .iter()
                .flat_map(|&i| self.x[i * f..(i + 1) * f].iter().copied())
                .collect(),
            y: idx.iter().map(|&i| self.y[i]).collect(),
        }
    }
    /// A seeded shuffle split: (train, test) with `test_frac` of the images in test.
    pub fn split(&self, test_frac: f64, seed: u64) -> (Dataset, Dataset) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        Rng::new(seed).shuffle(&mut idx);
        let n_test = (self.len() as f64 * test_frac).round() as usize;
        (self.subset(&idx[n_test..]), self.subset(&idx[..n_test]))
    }
    /// Writes images `idx` into the first rows of the blocked minibatch `x`
    /// (rows beyond `idx.len()` are zeroed) and returns their labels.
    pub fn fill_batch(&self, idx: &[usize], x: &mut Blocked) -> Vec<usize> {
        let f = self.features;
        x.data_mut().fill(0.0);
        for (r, &i) in idx.iter().enumerate() {
            for c in 0..f {
                let at = x.index(r, c);
                x.data_mut()[at] = self.x[i * f + c];
            }
        }
        idx.iter().map(|&i| self.y[i]).collect()
    }
}

pub use crate::error::DataError;

/// Where the Debian package `dataset-fashion-mnist` installs Fashion-MNIST.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Images of a data set with their geometry, for convolutional networks.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSet {
    /// Channels, height, width of every image.
    pub dims: (usize, usize, usize),
    /// Images as rows of `c * h * w` features in NCHW order.
    pub data: Dataset,
}

/// Fashion-MNIST (Xiao, Rasul and Vollgraf 2017, MIT licence) from the IDX
/// files in `dir` (plain or gzipped, as the Debian package
/// `dataset-fashion-mnist` ships them): `(train, test)`, 60000 and 10000
/// images of 1x28x28, pixels scaled to [0, 1], 10 classes.
pub fn fashion_mnist(dir: &std::path::Path) -> Result<(ImageSet, ImageSet), DataError> {
    let find = |stem: &str| -> Result<std::path::PathBuf, DataError> {
        for name in [format!("{stem}.gz"), stem.to_string()] {
            let p = dir.join(&name);
            if p.is_file() {
                return Ok(p);
            }
        }
        Err(DataError::Missing(format!(
            "Fashion-MNIST: no {stem}[.gz] in {}. Install the Debian package \
             (sudo apt-get install dataset-fashion-mnist, which puts the files in {FASHION_MNIST_DIR}) \
             or pass --data DIR with train-images-idx3-ubyte, train-labels-idx1-ubyte, \
             t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (optionally .gz)",
            dir.display()
        )))
    };
    let load = |images: &str, labels: &str| -> Result<ImageSet, DataError> {
        let (ip, lp) = (find(images)?, find(labels)?);
        let im = crate::idx::read_idx(&ip)?;
        let lb = crate::idx::read_idx(&lp)?;
        let bad = |reason: String| DataError::Format {
            source_name: ip.display().to_string(),
            reason,
        };
        if im.dims.len() != 3 || lb.dims.len() != 1 || im.dims[0] != lb.dims[0] {
            return Err(bad(format!(
                "images {:?} and labels {:?} do not match (want [n, h, w] and [n])",
                im.dims, lb.dims
            )));
        }
        if let Some(l) = lb.data.iter().find(|l| **l >= 10) {
            return Err(bad(format!("label {l} outside 0..10")));
        }
        let (h, w) = (im.dims[1], im.dims[2]);
        Ok(ImageSet {
            dims: (1, h, w),
            data: Dataset {
                features: h * w,
                classes: 10,
                x: im.data.iter().map(|p| *p as f32 / 255.0).collect(),
                y: lb.data.iter().map(|l| *l as usize).collect(),
            },
        })
    };
    let train = load("train-images-idx3-ubyte", "train-labels-idx1-ubyte")?;
    let test = load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?;
    check_same_images(&train, &test, dir)?;
    Ok((train, test))
}

/// An error unless `test`'s images have the size of `train`'s: a model
/// planned for one size must not be evaluated on another.
pub fn check_same_images(
    train: &ImageSet,
    test: &ImageSet,
    dir: &std::path::Path,
) -> Result<(), DataError> {
    if train.dims != test.dims {
        return Err(DataError::Format {
            source_name: dir.display().to_string(),
            reason: format!(
                "test images are {:?} (channels, height, width), training images {:?}",
                test.dims, train.dims
            ),
        });
    }
    Ok(())
}

/// The embedded UCI digits: 1797 images, 64 features scaled to [0, 1], 10 classes.
pub fn digits() -> Result<Dataset, DataError> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ).read_to_string(&mut text)?;
    parse_csv(&text, "digits.csv", 64, 16.0, 10)
}

/// Parses lines of `features` numbers then a label, dividing pixels by `scale`.
pub fn parse_csv(
    text: &str,
    name: &str,
    features: usize,
    scale: f32,
    classes: usize,
) -> Result<Dataset, DataError> {
    let mut d = Dataset {
        features,
        classes,
        x: vec![],
        y: vec![],
    };
    for (ln, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let err = |reason: String| DataError::Parse {
            source_name: name.into(),
            line: ln + 1,
            reason,
        };
        let vals: Vec<&str> = line.split(',').map(str::trim).collect();
        if vals.len() != features + 1 {
            return Err(err(format!(
                "expected {} fields, got {}",
                features + 1,
                vals.len()
            )));
        }
        for v in &vals[..features] {
            let p: f32 = v.parse().map_err(|_| err(format!("bad pixel {v:?}")))?;
            d.x.push(p / scale);
        }
        let label: usize = vals[features]
            .parse()
            .map_err(|_| err(format!("bad label {:?}", vals[features])))?;
        if label >= classes {
            return Err(err(format!("label {label} not below {classes}")));
        }
        d.y.push(label);
    }
    Ok(d)
}
