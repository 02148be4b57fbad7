pub mod bench;
pub mod cluster;
pub mod model_args;
pub mod run;
