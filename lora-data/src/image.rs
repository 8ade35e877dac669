//! image (in progress)
