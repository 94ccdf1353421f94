// Placeholder until the DistTensor implementation lands.
#include <shardline/dist/dist_tensor.h>
