//! Runnable examples of the lora-sdk.
