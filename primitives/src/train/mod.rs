//! What training needs beyond the layers: the loss, the optimizers,
//! initialisation, the non-finite guard and tuning files.

pub mod guard;
pub mod init;
pub mod loss;
pub mod optim;
pub mod tuning;
