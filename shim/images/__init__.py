"""ImageService interception: one module per RPC, sharing the ImageService struct."""
