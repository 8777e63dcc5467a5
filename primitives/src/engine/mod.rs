//! The engine every layer runs on: loop nests and the thread pool they run
//! on, blocked layouts and tensors with their typed block addressing, what
//! every pass's plan shares, and the vectorised element-wise helpers.

pub mod bf16;
pub(crate) mod fpenv;
pub mod layout;
pub mod loops;
pub(crate) mod math;
pub(crate) mod pass;
pub mod progress;
pub mod tensor;
pub mod threads;
pub(crate) mod view;
