//! cache (in progress)
