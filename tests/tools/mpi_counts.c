/* Count MPI collective calls and their bytes from outside the code under test (PMPI).
 *
 * Preload it (LD_PRELOAD) into each rank. MPI_Pcontrol(1) zeroes the counts;
 * MPI_Pcontrol(2) writes them to "$MPI_COUNTS_PREFIX.<rank>", one "name calls bytes" line each.
 * Build: mpicc -shared -fPIC -o libmpi_counts.so mpi_counts.c
 */
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ALLREDUCE, IALLREDUCE, ALLTOALL, IALLTOALL, ALLGATHER, IALLGATHER, BCAST, IBCAST, BARRIER, IBARRIER, NUM_OPS };
static const char *names[NUM_OPS] = {"MPI_Allreduce", "MPI_Iallreduce", "MPI_Alltoall", "MPI_Ialltoall",
                                     "MPI_Allgather", "MPI_Iallgather", "MPI_Bcast", "MPI_Ibcast",
                                     "MPI_Barrier", "MPI_Ibarrier"};
static long long calls[NUM_OPS], bytes[NUM_OPS];

static void count(int op, int n, MPI_Datatype type) {
    int size = 0;
    if (type != MPI_DATATYPE_NULL) PMPI_Type_size(type, &size);
    __atomic_add_fetch(&calls[op], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&bytes[op], (long long)n * size, __ATOMIC_RELAXED);
}

int MPI_Allreduce(const void *s, void *r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c) {
    count(ALLREDUCE, n, t);
    return PMPI_Allreduce(s, r, n, t, o, c);
}
int MPI_Iallreduce(const void *s, void *r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c, MPI_Request *q) {
    count(IALLREDUCE, n, t);
    return PMPI_Iallreduce(s, r, n, t, o, c, q);
}
int MPI_Alltoall(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c) {
    count(ALLTOALL, sn, st);
    return PMPI_Alltoall(s, sn, st, r, rn, rt, c);
}
int MPI_Ialltoall(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c,
                  MPI_Request *q) {
    count(IALLTOALL, sn, st);
    return PMPI_Ialltoall(s, sn, st, r, rn, rt, c, q);
}
int MPI_Allgather(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c) {
    count(ALLGATHER, sn, st);
    return PMPI_Allgather(s, sn, st, r, rn, rt, c);
}
int MPI_Iallgather(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt, MPI_Comm c,
                   MPI_Request *q) {
    count(IALLGATHER, sn, st);
    return PMPI_Iallgather(s, sn, st, r, rn, rt, c, q);
}
int MPI_Bcast(void *b, int n, MPI_Datatype t, int root, MPI_Comm c) {
    count(BCAST, n, t);
    return PMPI_Bcast(b, n, t, root, c);
}
int MPI_Ibcast(void *b, int n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request *q) {
    count(IBCAST, n, t);
    return PMPI_Ibcast(b, n, t, root, c, q);
}
int MPI_Barrier(MPI_Comm c) {
    count(BARRIER, 0, MPI_DATATYPE_NULL);
    return PMPI_Barrier(c);
}
int MPI_Ibarrier(MPI_Comm c, MPI_Request *q) {
    count(IBARRIER, 0, MPI_DATATYPE_NULL);
    return PMPI_Ibarrier(c, q);
}

int MPI_Pcontrol(const int level, ...) {
    if (level == 1) {
        memset(calls, 0, sizeof calls);
        memset(bytes, 0, sizeof bytes);
    } else if (level == 2) {
        const char *prefix = getenv("MPI_COUNTS_PREFIX");
        char path[4096];
        int rank = 0;
        PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
        snprintf(path, sizeof path, "%s.%d", prefix ? prefix : "mpi_counts", rank);
        FILE *f = fopen(path, "w");
        if (f == NULL) return MPI_ERR_OTHER;
        for (int i = 0; i < NUM_OPS; i++) fprintf(f, "%s %lld %lld\n", names[i], calls[i], bytes[i]);
        fclose(f);
    }
    return MPI_SUCCESS;
}
