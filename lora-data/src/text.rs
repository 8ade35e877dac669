//! text (in progress)
