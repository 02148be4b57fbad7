pub mod bench;
pub mod model_args;
pub mod run;
