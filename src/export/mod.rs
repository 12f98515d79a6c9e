//! HuggingFace interop: a ferrotron checkpoint as a `transformers` model and back.

pub mod hf_export;
pub mod hf_files;
pub mod hf_import;
pub mod hf_llama;
pub mod hf_model;
