pub mod bench;
pub mod cluster;
pub mod eval;
pub mod health;
pub mod model_args;
pub mod plan;
pub mod run;
