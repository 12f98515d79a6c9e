//! HuggingFace interop: a ferrotron checkpoint as a `transformers` model and back.

pub mod hf_export;
pub mod hf_import;
