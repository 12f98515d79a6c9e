/* The baseline of benchmarks/mpi_scaling.rs: Open MPI's own MPI_Allreduce (f32 sum), timed
 * exactly as the Rust side times ferrotron's MPI communicator. Prints one line per size:
 * "<bytes> <seconds per call>". Built and run by the benchmark with mpicc / mpirun. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const long sizes[] = {1L << 20, 16L << 20, 64L << 20};
  for (int s = 0; s < 3; s++) {
    long n = sizes[s] / 4;
    float *in = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));
    for (long i = 0; i < n; i++) in[i] = (float)(i % 7);
    int iters = sizes[s] >= (16L << 20) ? 5 : 20;
    MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); /* warm-up */
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int k = 0; k < iters; k++)
      MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = (MPI_Wtime() - start) / iters;
    double worst;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) printf("%ld %.9f\n", sizes[s], worst);
    free(in);
    free(out);
  }
  MPI_Finalize();
  return 0;
}
