/*
 * The native side of dlo_worker.offload.feeds.ring: pack mapped checkpoint views
 * through a ring of page-locked chunks small enough to stay in the CPU's cache, and
 * copy each chunk to the device as soon as it is packed.
 *
 * Why native: the copy of one 8-16 MiB chunk takes a fraction of a millisecond; a
 * Python thread that orders those copies competes for the interpreter with the thread
 * that launches the model's kernels and was measured spending as long per chunk as the
 * copy itself. Here no thread touches the interpreter.
 *
 * Threads: `lanes` packers and one feeder. Chunks are numbered globally across jobs;
 * chunk g uses ring slot g % ring. Whichever lane is free claims the next chunk (so a
 * lane the OS preempts delays one chunk, not every lanes-th chunk after it), once chunk
 * g - ring was handed to the stream, and before packing waits for that chunk's copy out
 * of the slot (its event, created with blocking sync: a waiting lane sleeps instead of
 * spinning on a CPU the other lanes, the feeder or the model's launch thread need).
 * The feeder alone talks to the copy stream, job by job; within a job it enqueues any
 * packed chunk, lowest first (next_packed_locked): before a job's first enqueued chunk it
 * makes the stream wait for the job's `wait_event` (the slot's release), after each chunk
 * it records the ring slot's event, after a job's last enqueued chunk it records the
 * job's `ready_event`. Python waits for a job to be *enqueued* (not copied) before it orders
 * compute after `ready_event`.
 *
 * Counters say where time went when a step runs slow: lanes packing, lanes idle (no
 * chunk submitted), lanes waiting for a ring slot, split into waiting for the slot's copy
 * (the copy engine behind) and the rest (the feeder behind: the slot's previous chunk not
 * yet on the stream), the feeder waiting for the next chunk's pack (the packers behind),
 * and the feeder's time in CUDA calls. The threads' kernel ids (dlo_ring_thread_ids) let
 * the caller read from the kernel how long they waited for a CPU.
 *
 * Without a CUDA API (every function pointer NULL) the feeder copies chunks with memcpy
 * into host memory, so CI runs the same ring and packing logic on the CPU.
 *
 * No Python API is used: the library is loaded with ctypes, whose calls release the GIL.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_JOBS 256
#define CUDA_MEMCPY_HOST_TO_DEVICE 1
#define CUDA_EVENT_BLOCKING_SYNC 1
#define CUDA_EVENT_DISABLE_TIMING 2

typedef struct {
    int (*set_device)(int device);
    int (*memcpy_async)(void *dst, const void *src, size_t count, int kind, void *stream);
    int (*event_create_with_flags)(void **event, unsigned int flags);
    int (*event_destroy)(void *event);
    int (*event_record)(void *event, void *stream);
    int (*event_synchronize)(void *event);
    int (*stream_wait_event)(void *stream, void *event, unsigned int flags);
} dlo_cuda_api;

typedef struct {
    uint64_t source;     /* host address of the mapped bytes */
    uint64_t offset;     /* byte offset in the destination */
    uint64_t nbytes;
} dlo_piece;

typedef struct {
    const dlo_piece *pieces;  /* sorted by offset, not overlapping; owned by the caller */
    uint64_t npieces;
    char *destination;
    uint64_t nbytes;
    void *wait_event;
    void *start_event;
    void *ready_event;
    void *end_event;
    uint64_t first_chunk;
    uint64_t nchunks;
    uint64_t chunks_enqueued; /* the feeder's: chunks of this job on the stream */
} dlo_job;

typedef struct {
    uint64_t packed_bytes;
    uint64_t pack_ns;           /* summed over lanes: time spent packing */
    uint64_t lane_idle_ns;      /* summed over lanes: no chunk submitted to pack */
    uint64_t ring_full_wait_ns; /* summed over lanes: a chunk to pack, its ring slot busy */
    uint64_t feeder_wait_ns;    /* the feeder waiting for the next chunk's pack */
    uint64_t feeder_idle_ns;    /* the feeder with no chunk submitted */
    uint64_t chunks;            /* chunks handed to the stream */
    uint64_t copy_wait_ns;      /* part of ring_full_wait_ns: the slot's copy still running */
    uint64_t feeder_enqueue_ns; /* the feeder in CUDA calls, putting copies on the stream */
} dlo_ring_stats;

typedef struct {
    dlo_cuda_api api;
    int cuda;
    int device;
    void *stream;
    char *ring;
    uint64_t chunk_bytes;
    uint64_t nring;
    void **events;
    int64_t *packed;   /* per ring slot: the global chunk packed there and not yet enqueued */
    int64_t *released; /* per ring slot: the last chunk enqueued from it (-1: none yet) */
    int nlanes;
    pthread_t *lanes;
    pthread_t feeder;
    int threads_started;
    int64_t *thread_ids; /* the kernel's ids of the feeder and the lanes, as they start */
    int nthread_ids;

    pthread_mutex_t mutex;
    pthread_cond_t changed;
    dlo_job jobs[MAX_JOBS];
    uint64_t jobs_submitted;
    uint64_t jobs_enqueued;
    uint64_t chunks_submitted;
    uint64_t chunks_claimed; /* the next chunk a free lane packs */
    int stopping;
    int error;
    dlo_ring_stats stats;
} dlo_ring;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Record the first failure and wake every waiter; the caller holds the mutex. */
static void fail_locked(dlo_ring *ring, int error) {
    if (!ring->error) ring->error = error ? error : -1;
    ring->stopping = 1;
    pthread_cond_broadcast(&ring->changed);
}

static void fail(dlo_ring *ring, int error) {
    pthread_mutex_lock(&ring->mutex);
    fail_locked(ring, error);
    pthread_mutex_unlock(&ring->mutex);
}

/* The job that holds global chunk `chunk`: not yet enqueued, so at or after jobs_enqueued. */
static const dlo_job *job_of_locked(dlo_ring *ring, uint64_t chunk) {
    for (uint64_t id = ring->jobs_enqueued; id < ring->jobs_submitted; id++) {
        const dlo_job *job = &ring->jobs[id % MAX_JOBS];
        if (chunk >= job->first_chunk && chunk < job->first_chunk + job->nchunks) return job;
    }
    return NULL;
}

/* Write destination bytes [low, high) of `job` into `target`, zeroing the gaps. */
static void pack(const dlo_job *job, uint64_t low, uint64_t high, char *target) {
    uint64_t first = 0, last = job->npieces;
    while (first < last) { /* the first piece that ends after `low` */
        uint64_t middle = first + (last - first) / 2;
        const dlo_piece *piece = &job->pieces[middle];
        if (piece->offset + piece->nbytes <= low) first = middle + 1; else last = middle;
    }
    uint64_t cursor = low;
    for (uint64_t index = first; index < job->npieces; index++) {
        const dlo_piece *piece = &job->pieces[index];
        if (piece->offset >= high) break;
        uint64_t begin = piece->offset > low ? piece->offset : low;
        uint64_t end = piece->offset + piece->nbytes < high ? piece->offset + piece->nbytes : high;
        if (begin > cursor) memset(target + (cursor - low), 0, begin - cursor);
        memcpy(target + (begin - low), (const char *)(uintptr_t)piece->source + (begin - piece->offset),
               end - begin);
        cursor = end;
    }
    if (cursor < high) memset(target + (cursor - low), 0, high - cursor);
}

/* Note the calling thread's kernel id, for dlo_ring_thread_ids. */
static void record_thread_id(dlo_ring *ring) {
    pthread_mutex_lock(&ring->mutex);
    ring->thread_ids[ring->nthread_ids++] = (int64_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&ring->changed);
    pthread_mutex_unlock(&ring->mutex);
}

static void *run_lane(void *argument) {
    dlo_ring *ring = argument;
    record_thread_id(ring);
    if (ring->cuda && ring->api.set_device(ring->device) != 0) {
        fail(ring, -2);
        return NULL;
    }
    for (;;) {
        uint64_t idle = 0, ring_full = 0;
        pthread_mutex_lock(&ring->mutex);
        for (;;) {
            uint64_t next = ring->chunks_claimed;
            int no_work = next >= ring->chunks_submitted;
            /* The ring slot's previous chunk must be on the stream before it is overwritten. */
            int slot_busy = next >= ring->nring &&
                            ring->released[next % ring->nring] != (int64_t)(next - ring->nring);
            if (ring->stopping || !(no_work || slot_busy)) break;
            uint64_t waited = now_ns();
            pthread_cond_wait(&ring->changed, &ring->mutex);
            *(no_work ? &idle : &ring_full) += now_ns() - waited;
        }
        if (ring->stopping) {
            pthread_mutex_unlock(&ring->mutex);
            return NULL;
        }
        uint64_t chunk = ring->chunks_claimed++;
        const dlo_job *found = job_of_locked(ring, chunk);
        dlo_job job = *found;
        pthread_mutex_unlock(&ring->mutex);
        uint64_t slot = chunk % ring->nring;
        uint64_t copy_wait = 0; /* the copy out of the ring slot was still running */
        if (ring->cuda && chunk >= ring->nring) {
            uint64_t waited = now_ns();
            int status = ring->api.event_synchronize(ring->events[slot]);
            if (status != 0) {
                fail(ring, status);
                return NULL;
            }
            copy_wait = now_ns() - waited;
        }
        ring_full += copy_wait;
        uint64_t began = now_ns();
        uint64_t low = (chunk - job.first_chunk) * ring->chunk_bytes;
        uint64_t high = low + ring->chunk_bytes < job.nbytes ? low + ring->chunk_bytes : job.nbytes;
        pack(&job, low, high, ring->ring + slot * ring->chunk_bytes);
        uint64_t ended = now_ns();
        pthread_mutex_lock(&ring->mutex);
        ring->packed[slot] = (int64_t)chunk;
        ring->stats.packed_bytes += high - low;
        ring->stats.pack_ns += ended - began;
        ring->stats.lane_idle_ns += idle;
        ring->stats.ring_full_wait_ns += ring_full;
        ring->stats.copy_wait_ns += copy_wait;
        pthread_cond_broadcast(&ring->changed);
        pthread_mutex_unlock(&ring->mutex);
    }
}

/* The chunk the feeder enqueues next, -1 while none is packed: the lowest-numbered packed
 * chunk of the oldest job not wholly enqueued. Any packed chunk of that job may go, so a
 * lane that packs slowly (preempted, faulting pages in) holds back only its own chunk, not
 * the copy engine; chunks of later jobs wait, so the stream waits for a job's slot release
 * only after every copy of the jobs before it. */
static int64_t next_packed_locked(dlo_ring *ring) {
    if (ring->jobs_enqueued >= ring->jobs_submitted) return -1;
    const dlo_job *job = &ring->jobs[ring->jobs_enqueued % MAX_JOBS];
    uint64_t end = job->first_chunk + job->nchunks;
    int64_t best = -1;
    for (uint64_t slot = 0; slot < ring->nring; slot++) {
        int64_t chunk = ring->packed[slot];
        if (chunk >= 0 && (uint64_t)chunk < end && (best < 0 || chunk < best)) best = chunk;
    }
    return best;
}

/* Put chunk `chunk` of `job` on the stream: after the job's `wait_event` when it is the
 * job's first chunk enqueued (`first`), before its `ready_event` when it is the last. */
static int enqueue(dlo_ring *ring, const dlo_job *job, uint64_t chunk, int first, int last) {
    uint64_t slot = chunk % ring->nring;
    uint64_t low = (chunk - job->first_chunk) * ring->chunk_bytes;
    uint64_t high = low + ring->chunk_bytes < job->nbytes ? low + ring->chunk_bytes : job->nbytes;
    char *source = ring->ring + slot * ring->chunk_bytes;
    if (!ring->cuda) {
        memcpy(job->destination + low, source, high - low);
        return 0;
    }
    int status = 0;
    if (first && job->wait_event) status = ring->api.stream_wait_event(ring->stream, job->wait_event, 0);
    if (!status && first && job->start_event) status = ring->api.event_record(job->start_event, ring->stream);
    if (!status)
        status = ring->api.memcpy_async(job->destination + low, source, high - low,
                                        CUDA_MEMCPY_HOST_TO_DEVICE, ring->stream);
    if (!status) status = ring->api.event_record(ring->events[slot], ring->stream);
    if (!status && last && job->ready_event) status = ring->api.event_record(job->ready_event, ring->stream);
    if (!status && last && job->end_event) status = ring->api.event_record(job->end_event, ring->stream);
    return status;
}

static void *run_feeder(void *argument) {
    dlo_ring *ring = argument;
    record_thread_id(ring);
    if (ring->cuda && ring->api.set_device(ring->device) != 0) {
        fail(ring, -2);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&ring->mutex);
        int64_t next;
        while (!ring->stopping && (next = next_packed_locked(ring)) < 0) {
            int no_work = ring->jobs_enqueued >= ring->jobs_submitted;
            uint64_t waited = now_ns();
            pthread_cond_wait(&ring->changed, &ring->mutex);
            *(no_work ? &ring->stats.feeder_idle_ns : &ring->stats.feeder_wait_ns) += now_ns() - waited;
        }
        if (ring->stopping) {
            pthread_mutex_unlock(&ring->mutex);
            return NULL;
        }
        uint64_t chunk = (uint64_t)next;
        /* Not reused while this job is not wholly enqueued (dlo_ring_submit waits). */
        dlo_job *job = &ring->jobs[ring->jobs_enqueued % MAX_JOBS];
        dlo_job copy = *job;
        int first = job->chunks_enqueued == 0, last = job->chunks_enqueued + 1 == job->nchunks;
        pthread_mutex_unlock(&ring->mutex);
        uint64_t began = now_ns();
        int status = enqueue(ring, &copy, chunk, first, last);
        uint64_t enqueued = now_ns();
        pthread_mutex_lock(&ring->mutex);
        if (status) {
            fail_locked(ring, status);
            pthread_mutex_unlock(&ring->mutex);
            return NULL;
        }
        ring->packed[chunk % ring->nring] = -1;
        ring->released[chunk % ring->nring] = (int64_t)chunk;
        job->chunks_enqueued += 1;
        ring->stats.chunks += 1;
        if (ring->cuda) ring->stats.feeder_enqueue_ns += enqueued - began;
        if (last) ring->jobs_enqueued += 1;
        pthread_cond_broadcast(&ring->changed);
        pthread_mutex_unlock(&ring->mutex);
    }
}

void dlo_ring_destroy(dlo_ring *ring);

/* A ring over `nring` chunks of `chunk_bytes` at `memory` (page-locked when `api` is
 * given), `lanes` packer threads; NULL on failure with *error set. */
dlo_ring *dlo_ring_create(const dlo_cuda_api *api, int device, void *stream, char *memory,
                          uint64_t chunk_bytes, uint64_t nring, int lanes, int *error) {
    *error = 0;
    if (!memory || chunk_bytes == 0 || nring < 2 || lanes < 1) {
        *error = EINVAL;
        return NULL;
    }
    dlo_ring *ring = calloc(1, sizeof(dlo_ring));
    if (!ring) {
        *error = ENOMEM;
        return NULL;
    }
    if (api) ring->api = *api;
    ring->cuda = api != NULL;
    ring->device = device;
    ring->stream = stream;
    ring->ring = memory;
    ring->chunk_bytes = chunk_bytes;
    ring->nring = nring;
    ring->nlanes = lanes;
    pthread_mutex_init(&ring->mutex, NULL);
    pthread_cond_init(&ring->changed, NULL);
    ring->events = calloc(nring, sizeof(void *));
    ring->packed = malloc(nring * sizeof(int64_t));
    ring->released = malloc(nring * sizeof(int64_t));
    ring->lanes = calloc((size_t)lanes, sizeof(pthread_t));
    ring->thread_ids = calloc((size_t)lanes + 1, sizeof(int64_t));
    if (!ring->events || !ring->packed || !ring->released || !ring->lanes || !ring->thread_ids) {
        *error = ENOMEM;
        dlo_ring_destroy(ring);
        return NULL;
    }
    for (uint64_t slot = 0; slot < nring; slot++) ring->packed[slot] = ring->released[slot] = -1;
    if (ring->cuda) {
        int status = ring->api.set_device(device);
        for (uint64_t slot = 0; !status && slot < nring; slot++)
            status = ring->api.event_create_with_flags(
                &ring->events[slot], CUDA_EVENT_BLOCKING_SYNC | CUDA_EVENT_DISABLE_TIMING);
        if (status) {
            *error = status;
            dlo_ring_destroy(ring);
            return NULL;
        }
    }
    if (pthread_create(&ring->feeder, NULL, run_feeder, ring) != 0) {
        *error = EAGAIN;
        dlo_ring_destroy(ring);
        return NULL;
    }
    ring->threads_started = 1;
    for (int lane = 0; lane < lanes; lane++) {
        if (pthread_create(&ring->lanes[lane], NULL, run_lane, ring) != 0) {
            ring->nlanes = lane; /* join only the lanes that run */
            *error = EAGAIN;
            dlo_ring_destroy(ring);
            return NULL;
        }
    }
    return ring;
}

/* Queue `pieces` (sorted by offset) to fill `destination[0, nbytes)`: the stream waits
 * for `wait_event` first, then records `start_event`; after the last copy it records
 * `ready_event` and `end_event` (each may be NULL). Returns the job's id (>= 0), or a
 * negative error. Blocks while the job queue is full. */
int64_t dlo_ring_submit(dlo_ring *ring, const dlo_piece *pieces, uint64_t npieces,
                        char *destination, uint64_t nbytes, void *wait_event, void *start_event,
                        void *ready_event, void *end_event) {
    if (nbytes == 0) return -EINVAL;
    pthread_mutex_lock(&ring->mutex);
    while (!ring->stopping && ring->jobs_submitted - ring->jobs_enqueued >= MAX_JOBS)
        pthread_cond_wait(&ring->changed, &ring->mutex);
    if (ring->stopping) {
        int error = ring->error;
        pthread_mutex_unlock(&ring->mutex);
        return -(int64_t)(error ? (error > 0 ? error : -error) : ECANCELED);
    }
    uint64_t id = ring->jobs_submitted;
    dlo_job *job = &ring->jobs[id % MAX_JOBS];
    job->pieces = pieces;
    job->npieces = npieces;
    job->destination = destination;
    job->nbytes = nbytes;
    job->wait_event = wait_event;
    job->start_event = start_event;
    job->ready_event = ready_event;
    job->end_event = end_event;
    job->first_chunk = ring->chunks_submitted;
    job->nchunks = (nbytes + ring->chunk_bytes - 1) / ring->chunk_bytes;
    job->chunks_enqueued = 0;
    ring->chunks_submitted += job->nchunks;
    ring->jobs_submitted = id + 1;
    pthread_cond_broadcast(&ring->changed);
    pthread_mutex_unlock(&ring->mutex);
    return (int64_t)id;
}

/* Block until job `id` is enqueued on the stream (copied, without CUDA). Returns 0, or
 * the first error of the ring (a CUDA status, or a negative code of its own). */
int dlo_ring_wait(dlo_ring *ring, int64_t id) {
    pthread_mutex_lock(&ring->mutex);
    while (!ring->error && ring->jobs_enqueued <= (uint64_t)id)
        pthread_cond_wait(&ring->changed, &ring->mutex);
    int error = ring->jobs_enqueued > (uint64_t)id ? 0 : ring->error;
    pthread_mutex_unlock(&ring->mutex);
    return error;
}

/* The kernel ids of the ring's threads (the feeder and every lane), once all have started:
 * copies at most `capacity` into `ids` and returns how many threads there are. */
int dlo_ring_thread_ids(dlo_ring *ring, int64_t *ids, int capacity) {
    pthread_mutex_lock(&ring->mutex);
    while (!ring->stopping && ring->nthread_ids < ring->nlanes + 1)
        pthread_cond_wait(&ring->changed, &ring->mutex);
    int count = ring->nthread_ids;
    for (int index = 0; index < count && index < capacity; index++) ids[index] = ring->thread_ids[index];
    pthread_mutex_unlock(&ring->mutex);
    return count;
}

void dlo_ring_stats_read(dlo_ring *ring, dlo_ring_stats *stats) {
    pthread_mutex_lock(&ring->mutex);
    *stats = ring->stats;
    pthread_mutex_unlock(&ring->mutex);
}

/* Stop the threads (after outstanding jobs were waited for) and free the ring's own
 * state; the chunk memory is the caller's, and the caller synchronizes the stream. */
void dlo_ring_destroy(dlo_ring *ring) {
    if (!ring) return;
    pthread_mutex_lock(&ring->mutex);
    ring->stopping = 1;
    pthread_cond_broadcast(&ring->changed);
    pthread_mutex_unlock(&ring->mutex);
    if (ring->threads_started) {
        pthread_join(ring->feeder, NULL);
        for (int lane = 0; lane < ring->nlanes; lane++) pthread_join(ring->lanes[lane], NULL);
    }
    if (ring->cuda && ring->events) {
        for (uint64_t slot = 0; slot < ring->nring; slot++)
            if (ring->events[slot]) ring->api.event_destroy(ring->events[slot]);
    }
    free(ring->events);
    free(ring->packed);
    free(ring->released);
    free(ring->lanes);
    free(ring->thread_ids);
    pthread_cond_destroy(&ring->changed);
    pthread_mutex_destroy(&ring->mutex);
    free(ring);
}
