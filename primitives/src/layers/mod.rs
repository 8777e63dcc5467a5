//! The layers, each forward and backward as loop nests around the BRGEMM
//! kernel: fully connected (f32 and bf16), convolution, LSTM/RNN, pooling,
//! batch normalisation and the element-wise steps.

pub(crate) mod act;
pub mod conv;
pub mod eltwise;
pub mod fc;
pub mod fc_bf16;
pub mod norm;
pub mod pool2d;
pub mod rnn;
