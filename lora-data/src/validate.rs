//! validate (in progress)
