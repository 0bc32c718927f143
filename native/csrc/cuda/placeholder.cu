// Removed once the first real kernel file lands.
__global__ void ftpatch_placeholder_kernel() {}
