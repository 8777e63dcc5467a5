//! The fixed model templates built from the layers: [`model::Mlp`],
//! [`cnn::Cnn`] and [`seqnet::SeqClassifier`], each owning its parameters,
//! gradients and optimizer state.

pub mod cnn;
pub mod model;
pub mod seqnet;
